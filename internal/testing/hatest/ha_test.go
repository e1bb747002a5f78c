package hatest

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/hacluster"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/skiplocked"
)

// long reports whether the long form was asked for (PGFENCE_HA_LONG=1).
func long() bool {
	v, _ := strconv.ParseBool(os.Getenv("PGFENCE_HA_LONG"))
	return v
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func startCluster(t *testing.T, mode hacluster.Mode) *hacluster.Cluster {
	t.Helper()
	return hacluster.Start(t, hacluster.Options{Mode: mode, OnRoleChange: onRoleChangeScript, Logf: t.Logf})
}

// TestHA is the short form: pgfence under load through one planned
// switchover and one failover (the primary's postmaster killed,
// primary_start_timeout 0) of a Patroni cluster in synchronous mode. No
// acknowledged token may be granted again, no acknowledged fenced write or
// completion may be lost, no job completed twice, no stale write accepted.
func TestHA(t *testing.T) {
	began := time.Now()
	c := startCluster(t, hacluster.Sync)
	s := newScenario(t, c, false)
	s.warmup()
	s.runEvent(kindSwitchover)
	s.runEvent(kindPostmasterKill)
	sum := s.finish()
	t.Logf("short form: %s", sum)
	if err := c.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if left := c.Leftovers(); len(left) > 0 {
		t.Fatalf("processes left after stop: %v", left)
	}
	t.Logf("short form took %v (bootstrap %v)", time.Since(began).Round(time.Millisecond), c.Bootstrap.Round(time.Millisecond))
}

// TestHALong is the long form (PGFENCE_HA_LONG=1): PGFENCE_HA_ROUNDS
// (default 20) events of each kind — switchover, postmaster kill, node kill,
// paused primary — in synchronous mode, a quarter as many in strict
// synchronous mode, and as many as in synchronous mode with asynchronous
// replication and the epoch bump; then a table.
func TestHALong(t *testing.T) {
	if !long() {
		t.Skip("long form: set PGFENCE_HA_LONG=1 (and PGFENCE_HA_ROUNDS, default 20)")
	}
	rounds := envInt("PGFENCE_HA_ROUNDS", 20)
	modes := os.Getenv("PGFENCE_HA_MODES") // e.g. "async"; default all three
	began := time.Now()
	c := startCluster(t, hacluster.Sync)
	kinds := []eventKind{kindSwitchover, kindPostmasterKill, kindNodeKill, kindPause}
	var events []*event
	var sums []summary
	for _, run := range []struct {
		mode   hacluster.Mode
		rounds int
	}{{hacluster.Sync, rounds}, {hacluster.SyncStrict, max(1, rounds/4)}, {hacluster.Async, rounds}} {
		if modes != "" && !strings.Contains(","+modes+",", ","+run.mode.String()+",") {
			continue
		}
		if c.Mode() != run.mode {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			err := c.SetMode(ctx, run.mode)
			cancel()
			if err != nil {
				t.Fatalf("set mode %s: %v%s", run.mode, err, c.Logs(30))
			}
		}
		s := newScenario(t, c, run.mode == hacluster.Async)
		s.warmup()
		for i := range run.rounds {
			for _, k := range kinds {
				s.runEvent(k)
			}
			t.Logf("%s: round %d of %d done after %v", run.mode, i+1, run.rounds, time.Since(began).Round(time.Second))
		}
		sum := s.finish()
		t.Logf("%s: %s", run.mode, sum)
		sums = append(sums, sum)
		events = append(events, s.events...)
	}
	if err := c.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	table := formatTable(events, sums, c.Bootstrap, time.Since(began))
	t.Log("\n" + table)
	if out := os.Getenv("PGFENCE_HA_TABLE"); out != "" {
		if err := os.WriteFile(out, []byte(table), 0o644); err != nil {
			t.Error(err)
		}
	}
}

// TestHANoEpochReported is the checker's own proof in the long form
// (PGFENCE_HA_LONG=1): with asynchronous replication and no epoch gate or
// bump, a paused primary keeps acknowledging grants on its open connections
// after a replica took over, and the new primary issues those tokens again
// to other holders. The history checker must report that history as
// illegal, with the same load that it finds legal with the gate and the
// bump installed (TestHALong's async rows). Up to three pauses, until one
// lost a grant whose token was issued again.
func TestHANoEpochReported(t *testing.T) {
	if !long() {
		t.Skip("long form: set PGFENCE_HA_LONG=1")
	}
	began := time.Now()
	c := startCluster(t, hacluster.Async)
	for attempt := 1; ; attempt++ {
		s := newScenario(t, c, false) // no HA epoch (pgfence.ha_enable) on an asynchronous cluster
		s.warmup()
		s.runEvent(kindPause)
		s.halt()
		reissued := 0
		s.rec.mu.Lock()
		seen := map[string]map[int64]bool{}
		for _, g := range s.rec.grants {
			if seen[g.Name] == nil {
				seen[g.Name] = map[int64]bool{}
			}
			if seen[g.Name][g.Token] {
				reissued++
			}
			seen[g.Name][g.Token] = true
		}
		s.rec.mu.Unlock()
		ops := s.hist.Ops()
		vs, sum := history.Check(ops)
		t.Logf("attempt %d: %d acknowledged (name, token) pairs granted twice; history %s; %d violations", attempt, reissued, sum, len(vs))
		if reissued > 0 {
			if len(vs) == 0 {
				dir, err := history.Save(ops, nil)
				t.Fatalf("%d tokens were granted twice without the epoch bump, yet the history checker found the history legal (history in %s, %v)", reissued, dir, err)
			}
			for i, v := range vs[:min(3, len(vs))] {
				t.Logf("reported %d: %s", i+1, v)
			}
			break
		}
		if attempt == 3 {
			t.Fatalf("3 paused primaries lost no grant that was issued again: the run could not show the violation")
		}
	}
	if err := c.Stop(); err != nil {
		t.Fatalf("stop: %v", err)
	}
	t.Logf("no epoch: the checker reported the reissued tokens; took %v", time.Since(began).Round(time.Second))
}

// warmup waits until every kind of client has done its work once.
func (s *scenario) warmup() {
	start := time.Now()
	deadline := start.Add(2 * time.Minute)
	for {
		s.rec.mu.Lock()
		n := len(s.rec.churnWrites)
		s.rec.mu.Unlock()
		if n >= churnKeys && s.worker.Summary().Completed > 0 && s.completedSince(start.Add(-time.Hour)) && s.holdersWroteSince(start.Add(-time.Hour)) {
			return
		}
		if time.Now().After(deadline) {
			s.t.Fatalf("load did not start within 2 minutes: %d churn writes, Worker %+v; errors %s", n, s.worker.Summary(), s.errSummary())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// summary is what one scenario's final checks found.
type summary struct {
	Mode            hacluster.Mode
	Events          int
	Grants          int // acknowledged grants
	TokensReissued  int // acknowledged (name, token) pairs granted more than once
	Regressions     int // grants not above a token acknowledged before they were sent
	Writes          int // acknowledged churn fenced writes
	WritesLost      int // of those, missing on the final primary
	StaleAccepted   int // ledger: a lower token written after a higher one
	StaleRefused    int // ended holders' and pre-bump writes refused
	Jobs            int // jobs in both queues, all completed at the end
	DoubleEffects   int // Worker jobs whose effect committed more than once
	Completions     int // acknowledged raw completions
	CompletionsLost int // of those, not the job's final completion
	ClaimsLost      int // raw completions refused (claim taken over)
	GrantsLost      int // async: acknowledged grants the new primary did not have (sum over events)
	GateRefused     int
	LeasesEnded     int
	LeasesSurvived  int
	Violations      int
}

func (s summary) String() string {
	return fmt.Sprintf("%d events; %d grants acknowledged, %d tokens re-issued, %d token regressions; %d fenced writes acknowledged, %d lost, %d stale accepted, %d stale refused; "+
		"%d jobs all completed, %d Worker effects doubled, %d raw completions acknowledged, %d lost, %d claims lost; async grants lost %d, gate refusals %d; "+
		"holder leases ended %d, survived %d; %d violations",
		s.Events, s.Grants, s.TokensReissued, s.Regressions, s.Writes, s.WritesLost, s.StaleAccepted, s.StaleRefused,
		s.Jobs, s.DoubleEffects, s.Completions, s.CompletionsLost, s.ClaimsLost, s.GrantsLost, s.GateRefused,
		s.LeasesEnded, s.LeasesSurvived, s.Violations)
}

// finish stops the load, drains both queues on the final primary and runs
// the checks over everything the clients were told.
func (s *scenario) finish() summary {
	t := s.t
	t.Helper()
	s.halt()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	if _, err := s.c.WaitHealthy(ctx); err != nil {
		t.Fatalf("final: %v%s", err, s.c.Logs(30))
	}
	s.checkHistory(ctx)
	sum := summary{Mode: s.c.Mode(), Events: len(s.events)}
	for _, ev := range s.events {
		sum.GrantsLost += ev.GrantsLost
		sum.LeasesEnded += ev.LeasesEnded
		sum.LeasesSurvived += ev.LeasesSurvived
		sum.StaleRefused += ev.StaleRefused
	}
	sync := s.c.Mode() != hacluster.Async

	// Drain what is left: the Worker's queue with the same handler, the raw
	// queue with a handler that does nothing (its claims' outcome is the
	// completion itself).
	cfg := &skiplocked.Config{Concurrency: 2, ClaimTTL: claimTTL, PollInterval: 100 * time.Millisecond}
	wtx, err := skiplocked.NewTxWorker(s.pool, txQueue, s.effect, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := wtx.Drain(ctx); err != nil {
		t.Fatalf("drain %s: %v", txQueue, err)
	}
	wraw, err := skiplocked.NewWorker(s.pool, rawQueue, func(context.Context, skiplocked.Job) error { return nil }, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := wraw.Drain(ctx); err != nil {
		t.Fatalf("drain %s: %v", rawQueue, err)
	}

	s.rec.mu.Lock()
	defer s.rec.mu.Unlock()
	rec := s.rec

	// Tokens: no acknowledged (name, token) twice; no grant below a token
	// acknowledged before it was sent.
	sum.Grants = len(rec.grants)
	seen := map[string]map[int64]string{}
	byName := map[string][]*grantRec{}
	for _, g := range rec.grants {
		if seen[g.Name] == nil {
			seen[g.Name] = map[int64]string{}
		}
		if other, dup := seen[g.Name][g.Token]; dup {
			sum.TokensReissued++
			if sync || sum.TokensReissued <= 5 {
				rec.violations = append(rec.violations, fmt.Sprintf("%s token %d granted to %s and to %s", g.Name, g.Token, other, g.Client))
			}
		}
		seen[g.Name][g.Token] = g.Client
		byName[g.Name] = append(byName[g.Name], g)
	}
	for name, gs := range byName {
		byAck := append([]*grantRec(nil), gs...)
		sort.Slice(byAck, func(i, j int) bool { return byAck[i].Ack.Before(byAck[j].Ack) })
		prefix := make([]int64, len(byAck))
		for i, g := range byAck {
			prefix[i] = g.Token
			if i > 0 {
				prefix[i] = max(prefix[i], prefix[i-1])
			}
		}
		for _, g := range gs {
			i := sort.Search(len(byAck), func(i int) bool { return !byAck[i].Ack.Before(g.Sent) }) - 1
			if i >= 0 && prefix[i] >= g.Token {
				sum.Regressions++
				if sync {
					rec.violations = append(rec.violations, fmt.Sprintf("%s: %s was granted %d although %d had been acknowledged before it asked", name, g.Client, g.Token, prefix[i]))
				}
			}
		}
	}

	// Fenced writes: every acknowledged one is in the ledger; per row the
	// ledger's tokens increase in commit order (no stale write accepted).
	rows, err := s.pool.Query(ctx, "SELECT name, token FROM ha_ledger ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	type lrow struct {
		Name  string
		Token int64
	}
	ledger, err := pgx.CollectRows(rows, pgx.RowToStructByPos[lrow])
	if err != nil {
		t.Fatal(err)
	}
	inLedger := map[lrow]bool{}
	last := map[string]int64{}
	for _, l := range ledger {
		if l.Token <= last[l.Name] {
			sum.StaleAccepted++
			rec.violations = append(rec.violations, fmt.Sprintf("ledger: %s written with token %d after token %d", l.Name, l.Token, last[l.Name]))
		}
		last[l.Name] = max(last[l.Name], l.Token)
		inLedger[l] = true
	}
	sum.Writes = len(rec.churnWrites)
	for _, w := range rec.churnWrites {
		if !inLedger[lrow{w.Name, w.Token}] {
			sum.WritesLost++
			if sync {
				rec.violations = append(rec.violations, fmt.Sprintf("acknowledged fenced write %s token %d (server port %d) is missing on the final primary", w.Name, w.Token, w.Port))
			}
		}
	}
	// Fence ≤ token on the final primary.
	s.rec.mu.Unlock()
	s.checkFenceBelowToken(ctx, "final")
	s.rec.mu.Lock()

	// Jobs: all completed; the Worker's effects exactly once; every
	// acknowledged raw completion is the job's final one.
	for _, q := range []string{txQueue, rawQueue} {
		ds, err := skiplocked.QueueDepths(ctx, s.pool, q)
		if err != nil {
			t.Fatal(err)
		}
		d := ds[0]
		total := d.Total()
		sum.Jobs += int(total)
		if d.Completed != total {
			rec.violations = append(rec.violations, fmt.Sprintf("queue %s: %+v, not all completed", q, d))
		}
	}
	var doubles, missing int
	if err := s.pool.QueryRow(ctx, `
		SELECT (SELECT count(*) FROM (SELECT job_id FROM ha_effects GROUP BY job_id HAVING count(*) > 1) d),
		       (SELECT count(*) FROM pgfence.jobs j WHERE j.queue = $1 AND NOT EXISTS (SELECT FROM ha_effects e WHERE e.job_id = j.id))`,
		txQueue).Scan(&doubles, &missing); err != nil {
		t.Fatal(err)
	}
	sum.DoubleEffects = doubles
	if doubles > 0 || missing > 0 {
		rec.violations = append(rec.violations, fmt.Sprintf("Worker queue: %d jobs with more than one effect, %d completed jobs without one", doubles, missing))
	}
	final := map[int64]int64{}
	rows, err = s.pool.Query(ctx, "SELECT id, claim_token FROM pgfence.jobs WHERE queue = $1 AND state = 'completed'", rawQueue)
	if err != nil {
		t.Fatal(err)
	}
	var id, tok int64
	if _, err := pgx.ForEachRow(rows, []any{&id, &tok}, func() error { final[id] = tok; return nil }); err != nil {
		t.Fatal(err)
	}
	sum.Completions = len(rec.completions)
	sum.ClaimsLost = rec.claimLost
	for _, cpl := range rec.completions {
		if final[cpl.JobID] != cpl.Token {
			sum.CompletionsLost++
			if sync {
				rec.violations = append(rec.violations, fmt.Sprintf("job %d: completion under claim %d was acknowledged, the final primary has it completed under claim %d", cpl.JobID, cpl.Token, final[cpl.JobID]))
			}
		}
	}
	sum.StaleRefused += rec.staleRefused
	sum.GateRefused = rec.gateRefusals
	if !sync && sum.StaleRefused == 0 && sum.Events > 0 {
		rec.violations = append(rec.violations, "async: no old token was probed after any bump")
	}
	sum.Violations = len(rec.violations)
	for i, v := range rec.violations {
		if i == 50 {
			t.Errorf("... and %d more violations", len(rec.violations)-50)
			break
		}
		t.Errorf("violation: %s", v)
	}
	t.Logf("client errors: %s", errSummaryLocked(rec))
	return sum
}

func errSummaryLocked(r *recorder) string {
	keys := make([]string, 0, len(r.errCounts))
	for k := range r.errCounts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "%s ×%d; ", k, r.errCounts[k])
	}
	return b.String()
}

// formatTable renders the long form's results as Markdown.
func formatTable(events []*event, sums []summary, bootstrap, took time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, "Long form: %d events in %v (bootstrap %v), %d CPUs, %s/%s\n\n", len(events), took.Round(time.Second), bootstrap.Round(100*time.Millisecond), runtime.NumCPU(), runtime.GOOS, runtime.GOARCH)
	b.WriteString("| mode | event | n | new leader key (median / max) | event → first grant on new primary (median / max) | longest grant gap (median / max) | healthy again (median / max) | async: event → bump committed (median / max) | holder leases ended / survived | async: acknowledged grants lost | async: old tokens refused after bump | gate refusals |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	type key struct {
		m hacluster.Mode
		k eventKind
	}
	groups := map[key][]*event{}
	var order []key
	for _, ev := range events {
		k := key{ev.Mode, ev.Kind}
		if _, ok := groups[k]; !ok {
			order = append(order, k)
		}
		groups[k] = append(groups[k], ev)
	}
	for _, k := range order {
		evs := groups[k]
		pick := func(f func(*event) time.Duration) string {
			ds := make([]time.Duration, len(evs))
			for i, e := range evs {
				ds[i] = f(e)
			}
			sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
			if ds[len(ds)-1] == 0 {
				return "–"
			}
			return fmt.Sprintf("%.1f / %.1f s", ds[len(ds)/2].Seconds(), ds[len(ds)-1].Seconds())
		}
		var ended, survived, lost, refused, gate int
		for _, e := range evs {
			ended += e.LeasesEnded
			survived += e.LeasesSurvived
			lost += e.GrantsLost
			refused += e.StaleRefused
			gate += e.GateRefused
		}
		async := "–"
		asyncRefused := "–"
		if k.m == hacluster.Async {
			async = strconv.Itoa(lost)
			asyncRefused = strconv.Itoa(refused)
		}
		fmt.Fprintf(&b, "| %s | %s | %d | %s | %s | %s | %s | %s | %d / %d | %s | %s | %d |\n", k.m, k.k, len(evs),
			pick(func(e *event) time.Duration { return e.NewLeader }),
			pick(func(e *event) time.Duration { return e.Unavailable }),
			pick(func(e *event) time.Duration { return e.Gap }),
			pick(func(e *event) time.Duration { return e.Healthy }),
			pick(func(e *event) time.Duration { return e.Bump }),
			ended, survived, async, asyncRefused, gate)
	}
	b.WriteString("\n| mode | events | grants acknowledged | tokens re-issued | token regressions | fenced writes acknowledged | lost | stale writes accepted | stale writes refused | jobs | effects doubled | raw completions acknowledged | lost | claims lost (refused) | violations |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, s := range sums {
		fmt.Fprintf(&b, "| %s | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d | %d |\n", s.Mode, s.Events, s.Grants, s.TokensReissued, s.Regressions,
			s.Writes, s.WritesLost, s.StaleAccepted, s.StaleRefused, s.Jobs, s.DoubleEffects, s.Completions, s.CompletionsLost, s.ClaimsLost, s.Violations)
	}
	return b.String()
}

// TestDocsCarryTheRecipe: docs/ha.md prints on_role_change.sh and the
// statement that enables the epoch exactly as the tests run them.
func TestDocsCarryTheRecipe(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join("..", "..", "..", "docs", "ha.md"))
	if err != nil {
		t.Fatal(err)
	}
	for name, text := range map[string]string{"the enabling statement": haEnableSQL, "on_role_change.sh": onRoleChangeScript} {
		if !strings.Contains(string(doc), text) {
			t.Errorf("docs/ha.md does not contain %s verbatim", name)
		}
	}
}

// checkHistory adds the epoch bumps the new primaries made (asynchronous
// mode) to the recorded history and checks it.
func (s *scenario) checkHistory(ctx context.Context) {
	if s.async {
		rows, err := s.pool.Query(ctx, "SELECT name, token_before, bumped_at FROM pgfence.ha_bumps ORDER BY bumped_at")
		if err != nil {
			s.t.Fatal(err)
		}
		type bump struct {
			Name   string
			Before int64
			At     time.Time
		}
		bumps, err := pgx.CollectRows(rows, pgx.RowToStructByPos[bump])
		if err != nil {
			s.t.Fatal(err)
		}
		for _, b := range bumps {
			// The bump commits after its transaction's start (bumped_at),
			// at a time the history does not know: its return is open.
			s.hist.Add(history.Op{Client: s.hist.Client(), Input: history.Input{Kind: history.Bump, Key: b.Name, Token: b.Before},
				Output: history.Output{Outcome: history.OK}, Call: s.hist.At(b.At), Return: math.MaxInt64})
		}
	}
	s.hist.Verify(s.t)
}
