package faultsuite

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

// Environment of an importer worker process (this test binary started again).
const (
	envImporter      = "PGFENCE_IMPORTER_WORKER" // worker name
	envImporterDSN   = "PGFENCE_IMPORTER_DSN"
	envImporterQueue = "PGFENCE_IMPORTER_QUEUE"
	envImporterMode  = "PGFENCE_IMPORTER_MODE" // tx or autocommit
	envImporterTTL   = "PGFENCE_IMPORTER_TTL"
)

// Importer modes: the effect in the Worker's transaction that completes the
// job (skiplocked.NewTxWorker), or committed on its own before the Worker
// completes the job (skiplocked.NewWorker).
const (
	modeTx         = "tx"
	modeAutocommit = "autocommit"
)

func init() {
	if name := os.Getenv(envImporter); name != "" {
		os.Exit(importerMain(name))
	}
}

// importerApp is the application_name of a worker process's sessions.
func importerApp(name string) string { return "faults-importer-" + name }

// importerMain is one importer process: it drains the queue with four
// handlers. Each handler writes the job's effect (a row of imported), in the
// Worker's transaction (tx mode) or committed at once (autocommit mode).
// For a job whose payload has "trap": true, the handler then prints
// "at-trap ID TOKEN" and waits for "go ID" on stdin before returning. The
// parent answers at once, except for the first arrival at each trap job: it
// then stops the process (SIGSTOP) until another worker has re-claimed and
// completed the job, and only then lets it go on. Losses reported to
// OnClaimLost are printed as "lost ID TOKEN CURRENT STATE"; the end of the
// drain as "summary ...".
func importerMain(name string) int {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var outMu sync.Mutex
	say := func(format string, args ...any) {
		outMu.Lock()
		defer outMu.Unlock()
		fmt.Printf(format+"\n", args...)
	}
	fail := func(err error) int { say("error %v", strings.Join(strings.Fields(err.Error()), " ")); return 1 }
	ttl, err := time.ParseDuration(os.Getenv(envImporterTTL))
	if err != nil {
		return fail(err)
	}
	cfg, err := pgxpool.ParseConfig(os.Getenv(envImporterDSN))
	if err != nil {
		return fail(err)
	}
	cfg.MaxConns = 8
	cfg.ConnConfig.RuntimeParams["application_name"] = importerApp(name)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()

	var goMu sync.Mutex
	resume := map[int64]chan struct{}{}
	gate := func(id int64) chan struct{} {
		goMu.Lock()
		defer goMu.Unlock()
		if resume[id] == nil {
			resume[id] = make(chan struct{})
		}
		return resume[id]
	}
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			if id, err := strconv.ParseInt(strings.TrimPrefix(sc.Text(), "go "), 10, 64); err == nil {
				close(gate(id))
			}
		}
	}()

	worker := fmt.Sprintf("%s/%d", name, os.Getpid())
	jr, err := importerJournal(worker, ttl)
	if err != nil {
		return fail(err)
	}
	trap := func(ctx context.Context, j skiplocked.Job) error {
		var p struct {
			Trap bool `json:"trap"`
		}
		if err := json.Unmarshal(j.Payload, &p); err != nil {
			return skiplocked.Permanent(err)
		}
		if !p.Trap {
			time.Sleep(rand.N(2 * time.Millisecond))
			return nil
		}
		g := gate(j.ID)
		say("at-trap %d %d", j.ID, j.ClaimToken)
		<-g // the parent may stop this process before it answers
		goMu.Lock()
		delete(resume, j.ID) // a later arrival (a re-claim by this process) asks again
		goMu.Unlock()
		return nil
	}
	effect := func(ctx context.Context, db pgfence.DBTX, j skiplocked.Job) error {
		_, err := db.Exec(ctx, "INSERT INTO imported (job_id, token, worker) VALUES ($1, $2, $3)", j.ID, j.ClaimToken, worker)
		return err
	}
	wcfg := &skiplocked.Config{
		Holder: worker, Concurrency: 4, BatchSize: 4, ClaimTTL: ttl, RenewInterval: ttl / 4,
		PollInterval: 50 * time.Millisecond, Backoff: func(int) time.Duration { return 0 },
		OnClaimLost: func(_ context.Context, j skiplocked.Job, e *pgfence.Error) {
			current, state := lostState(e)
			jr.lost(j.ID, e.Token, current, state)
			if state == "" {
				state = "unknown" // the job could not be read back (a paused worker's deadline passed)
			}
			say("lost %d %d %d %s", j.ID, e.Token, current, state)
		},
	}
	var w *skiplocked.Worker
	switch os.Getenv(envImporterMode) {
	case modeTx:
		w, err = skiplocked.NewTxWorker(pool, os.Getenv(envImporterQueue), func(ctx context.Context, tx pgx.Tx, j skiplocked.Job) error {
			return jr.handle(j, func() error {
				if err := effect(ctx, tx, j); err != nil {
					return err
				}
				return trap(ctx, j)
			})
		}, wcfg)
	case modeAutocommit:
		w, err = skiplocked.NewWorker(pool, os.Getenv(envImporterQueue), func(ctx context.Context, j skiplocked.Job) error {
			return jr.handle(j, func() error {
				if err := effect(ctx, pool, j); err != nil {
					return err
				}
				return trap(ctx, j)
			})
		}, wcfg)
	default:
		err = fmt.Errorf("unknown mode %q", os.Getenv(envImporterMode))
	}
	if err != nil {
		return fail(err)
	}
	sum, err := w.Drain(ctx)
	if err != nil {
		return fail(err)
	}
	if err := jr.settle(ctx, pool); err != nil {
		return fail(err)
	}
	say("summary claimed=%d completed=%d failed=%d dead=%d lost=%d unknown=%d",
		sum.Claimed, sum.Completed, sum.Failed, sum.Dead, sum.ClaimsLost, sum.Unknown)
	return 0
}

// importerRecorder journals what an importer process's Worker did with each
// job, as far as its handler sees it: a claim (called when the process
// started, returned when the handler ran, with the job's token and claim
// expiry), then the completion (or failure, when the handler returned an
// error) called when the handler returned. The Worker reports a refused
// one to OnClaimLost (outcome lost); after the drain, a completion is
// known to have been accepted when the job is completed under its token;
// every other one stays open (unknown): the process was killed, or it gave
// up on the outcome.
type importerRecorder struct {
	rec            *history.Recorder // nil: not recording
	holder         string
	ttl            time.Duration
	start          int64
	mu             sync.Mutex
	pending        map[[2]int64]*history.Pending // (job, token) → its completion, not returned yet
	lostBeforeDone map[[2]int64]bool             // lost while the handler ran: no completion follows
}

func importerJournal(holder string, ttl time.Duration) (*importerRecorder, error) {
	rec, err := history.FromEnv()
	if err != nil || rec == nil {
		return &importerRecorder{}, err
	}
	return &importerRecorder{rec: rec, holder: holder, ttl: ttl, start: rec.Now(),
		pending: map[[2]int64]*history.Pending{}, lostBeforeDone: map[[2]int64]bool{}}, nil
}

func (r *importerRecorder) handle(j skiplocked.Job, run func() error) error {
	if r.rec == nil {
		return run()
	}
	key := [2]int64{j.ID, j.ClaimToken}
	r.rec.Add(history.Op{Client: r.rec.Client(), Input: history.Input{Kind: history.Claim, Key: history.JobKey(j.ID), Holder: r.holder, TTL: r.ttl},
		Output: history.Output{Outcome: history.OK, Token: j.ClaimToken, Expires: history.Micros(j.ClaimExpiresAt)}, Call: r.start, Return: r.rec.Now()})
	err := run()
	kind := history.Complete
	if err != nil {
		kind = history.Fail
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.lostBeforeDone[key] {
		r.pending[key] = r.rec.Begin(r.rec.Client(), history.Input{Kind: kind, Key: history.JobKey(j.ID), Token: j.ClaimToken})
	}
	return err
}

// lostState reads from a lost claim's Reason (see skiplocked.Renew) the
// job's claim token and state now: "" when the job could not be read back,
// and e.Token when the claim of e.Token itself ended (already ended, or
// another key).
func lostState(e *pgfence.Error) (current int64, state string) {
	var job int64
	if _, err := fmt.Sscanf(e.Reason, "job %d: reclaimed by token %d, state %s", &job, &current, &state); err == nil {
		return current, state
	}
	if _, err := fmt.Sscanf(e.Reason, "job %d: not held under this token (current %d), state %s", &job, &current, &state); err == nil {
		return current, state
	}
	if strings.Contains(e.Reason, "could not be read back") {
		return 0, ""
	}
	_, state, _ = strings.Cut(e.Reason, ", state ")
	return e.Token, state
}

// lost records a loss the Worker reported. A loss it could not read back,
// or one naming its own token as current (the local deadline passed first),
// says nothing of the database: the completion stays open.
func (r *importerRecorder) lost(job, token, current int64, state string) {
	if r.rec == nil || state == "" || current == token {
		return
	}
	key := [2]int64{job, token}
	r.mu.Lock()
	defer r.mu.Unlock()
	if p := r.pending[key]; p != nil {
		p.End(history.Output{Outcome: history.Lost})
		delete(r.pending, key)
		return
	}
	r.lostBeforeDone[key] = true
}

// settle ends the completions the database shows accepted.
func (r *importerRecorder) settle(ctx context.Context, db pgfence.DBTX) error {
	if r.rec == nil {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for key, p := range r.pending {
		var done bool
		if err := db.QueryRow(ctx, "SELECT state = 'completed' AND claim_token = $2 FROM pgfence.jobs WHERE id = $1", key[0], key[1]).Scan(&done); err != nil {
			return err
		}
		if done {
			p.End(history.Output{Outcome: history.OK})
			delete(r.pending, key)
		}
	}
	return nil
}

// importerProc is one importer process as the parent sees it.
type importerProc struct {
	name  string
	cmd   *exec.Cmd
	stdin io.WriteCloser
	done  chan struct{} // closed when the process has exited and its output is read

	// Guarded by importRun.mu.
	traps       int               // traps of this process not resolved yet: it stays stopped
	awaiting    map[[2]int64]bool // (job, token) of resolved traps whose lost claim it has not reported yet
	chaosPaused bool              // stopped by the chaos loop
	killed      bool
	startedAt   int64 // on the recorder's clock, before the process started
	summary     map[string]int
	lost        int
	exitErr     error
}

// importRun is one import (one mode) under faults.
type importRun struct {
	t     *testing.T
	dsn   string
	queue string
	mode  string
	ttl   time.Duration
	admin *pgxpool.Pool

	rec      *history.Recorder // every process's claims and completions (journals)
	journals string

	mu      sync.Mutex
	procs   []*importerProc
	started int
	trapped map[int64]int64         // trap job → token of the claim stopped there
	trapper map[int64]*importerProc // trap job → the process stopped there
	lost    []lostReport
	errs    []string
	events  chan trapEvent
}

type lostReport struct {
	proc                string
	job, token, current int64
	state               string
}

// trapEvent is an arrival of a process at a trap job's trap point.
type trapEvent struct {
	p        *importerProc
	job, tok int64
}

// start launches a new importer process.
func (r *importRun) start() (*importerProc, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	r.started++
	name, base := fmt.Sprintf("%s-%d", r.mode, r.started), 100000*r.started
	r.mu.Unlock()
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), envImporter+"="+name, envImporterDSN+"="+r.dsn, envImporterQueue+"="+r.queue,
		envImporterMode+"="+r.mode, envImporterTTL+"="+r.ttl.String(),
		r.rec.JournalEnv(filepath.Join(r.journals, name), base))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = io.Discard
	startedAt := r.rec.Now()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &importerProc{name: name, cmd: cmd, stdin: stdin, done: make(chan struct{}), awaiting: map[[2]int64]bool{}, startedAt: startedAt}
	r.mu.Lock()
	r.procs = append(r.procs, p)
	r.mu.Unlock()
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			r.line(p, sc.Text())
		}
		err := cmd.Wait()
		r.mu.Lock()
		p.exitErr = err
		r.mu.Unlock()
	}()
	return p, nil
}

// stopAll ends every process (test cleanup).
func (r *importRun) stopAll() {
	r.mu.Lock()
	procs := append([]*importerProc(nil), r.procs...)
	r.mu.Unlock()
	for _, p := range procs {
		_ = p.cmd.Process.Signal(syscall.SIGCONT)
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// line handles one line of a worker's output.
func (r *importRun) line(p *importerProc, l string) {
	f := strings.Fields(l)
	num := func(i int) int64 {
		n, _ := strconv.ParseInt(f[i], 10, 64)
		return n
	}
	if len(f) == 3 && f[0] == "at-trap" {
		r.events <- trapEvent{p: p, job: num(1), tok: num(2)}
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case len(f) == 5 && f[0] == "lost":
		l := lostReport{proc: p.name, job: num(1), token: num(2), current: num(3), state: f[4]}
		r.lost = append(r.lost, l)
		p.lost++
		delete(p.awaiting, [2]int64{l.job, l.token})
	case len(f) > 0 && f[0] == "summary":
		p.summary = map[string]int{}
		for _, kv := range f[1:] {
			k, v, _ := strings.Cut(kv, "=")
			p.summary[k], _ = strconv.Atoi(v)
		}
	default:
		r.errs = append(r.errs, p.name+": "+l)
	}
}

// arrive handles a process's arrival at a trap point: the first live
// arrival at each trap job becomes the trap (the process is stopped until
// resolve lets it go); every other arrival goes on at once. It reports
// whether ev is a trap, and whether fewer than two processes are left
// running to take the trapped jobs over.
func (r *importRun) arrive(ev trapEvent) (trap, starved bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if ev.p.killed {
		return false, false // killed after it arrived: another worker will arrive
	}
	if _, done := r.trapped[ev.job]; done {
		_, _ = fmt.Fprintf(ev.p.stdin, "go %d\n", ev.job)
		return false, false
	}
	r.trapped[ev.job] = ev.tok
	r.trapper[ev.job] = ev.p
	ev.p.traps++
	_ = ev.p.cmd.Process.Signal(syscall.SIGSTOP)
	running := 0
	for _, p := range r.procs {
		select {
		case <-p.done:
		default:
			if !p.killed && p.traps == 0 && !p.chaosPaused {
				running++
			}
		}
	}
	return true, running < 2
}

// resolve keeps a trapped process stopped until another worker has
// re-claimed and completed the job, then lets the trapped handler go on.
func (r *importRun) resolve(ctx context.Context, ev trapEvent, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var tok int64
		var state string
		if err := r.admin.QueryRow(ctx, "SELECT claim_token, state FROM pgfence.jobs WHERE id = $1", ev.job).Scan(&tok, &state); err != nil {
			return err
		}
		if tok > ev.tok && state == string(skiplocked.StateCompleted) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("trap on job %d (token %d): not re-claimed and completed by another worker within %v (token %d, %s)",
				ev.job, ev.tok, timeout, tok, state)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	// The process must not be killed before it reports the loss.
	ev.p.awaiting[[2]int64{ev.job, ev.tok}] = true
	if _, err := fmt.Fprintf(ev.p.stdin, "go %d\n", ev.job); err != nil {
		return fmt.Errorf("trap on job %d: %s: %w", ev.job, ev.p.name, err)
	}
	ev.p.traps--
	if ev.p.traps == 0 && !ev.p.chaosPaused {
		_ = ev.p.cmd.Process.Signal(syscall.SIGCONT)
	}
	return nil
}

// importOutcome is what one import under faults produced.
type importOutcome struct {
	jobs, traps, pauses, kills, procs       int
	effects, duplicates, dupJobs, staleToks int
	lost, falseLost, unknown                int
	elapsed                                 time.Duration
}

// runImport enqueues jobs jobs (traps of them trapped) on a fresh database
// and drains them with four importer processes in the given mode while a
// chaos loop pauses workers past their claim (SIGSTOP) and kills them
// (SIGKILL, replaced by a new process). It checks what must hold in every
// mode and returns the figures.
func runImport(t *testing.T, mode string, jobs, traps int) importOutcome {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	admin := appPool(t, dsn, appAdmin, 6)
	if _, err := admin.Exec(ctx, `
		CREATE TABLE imported (id bigserial PRIMARY KEY, job_id bigint NOT NULL, token bigint NOT NULL, worker text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	// Round trips on this machine now (the median of 21): the claim TTL and
	// the waits below are scaled from it.
	rtts := make([]time.Duration, 21)
	for i := range rtts {
		s := time.Now()
		if _, err := admin.Exec(ctx, "SELECT 1"); err != nil {
			t.Fatal(err)
		}
		rtts[i] = time.Since(s)
	}
	slices.Sort(rtts)
	rtt := rtts[len(rtts)/2]
	const queue = "catalogue"
	ps := make([]skiplocked.EnqueueParams, jobs)
	every := jobs / traps
	for i := range ps {
		trap := i%every == every/2
		ps[i] = skiplocked.EnqueueParams{Queue: queue, MaxAttempts: 1000, Payload: json.RawMessage(fmt.Sprintf(`{"n":%d,"trap":%v}`, i, trap))}
	}
	enqueued, err := skiplocked.Enqueue(ctx, admin, ps...)
	if err != nil {
		t.Fatal(err)
	}
	r := &importRun{t: t, dsn: dsn, queue: queue, mode: mode, ttl: time.Second + 100*rtt, admin: admin,
		trapped: map[int64]int64{}, trapper: map[int64]*importerProc{}, events: make(chan trapEvent, 64),
		rec: history.New(), journals: t.TempDir()}
	t.Cleanup(r.stopAll)
	trapTimeout := 30*r.ttl + 2000*rtt
	start := time.Now()
	for range 4 {
		if _, err := r.start(); err != nil {
			t.Fatal(err)
		}
	}

	// Traps: stop the trapped process until the job was taken over; start
	// a new process when fewer than two are left running to take it over.
	trapErrs := make(chan error, traps+1)
	var trapWG sync.WaitGroup
	trapCtx, stopTraps := context.WithCancel(ctx)
	defer stopTraps()
	trapWG.Go(func() {
		var wg sync.WaitGroup
		defer wg.Wait()
		for {
			select {
			case <-trapCtx.Done():
				return
			case ev := <-r.events:
				trap, starved := r.arrive(ev)
				if !trap {
					continue
				}
				if starved {
					if _, err := r.start(); err != nil {
						trapErrs <- err
					}
				}
				wg.Go(func() {
					if err := r.resolve(trapCtx, ev, trapTimeout); err != nil && trapCtx.Err() == nil {
						trapErrs <- err
					}
				})
			}
		}
	})

	unfinished := func() int64 {
		var n int64
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pgfence.jobs WHERE queue = $1 AND state <> 'completed'", queue).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// Chaos: alternately kill a worker (and start a new one) and pause one
	// past its claim, every 300-600 ms, while a fifth of the jobs remain.
	pauses, kills := 0, 0
	for action := 0; ; action++ {
		time.Sleep(300*time.Millisecond + rand.N(300*time.Millisecond))
		if unfinished() < int64(jobs/5) {
			break
		}
		r.mu.Lock()
		var live []*importerProc
		for _, p := range r.procs {
			select {
			case <-p.done:
			default:
				if p.traps == 0 && len(p.awaiting) == 0 && !p.chaosPaused && !p.killed {
					live = append(live, p)
				}
			}
		}
		if len(live) == 0 {
			r.mu.Unlock()
			continue
		}
		// Kill or stop it under the lock that designates traps, so that it
		// holds no trap and owes no lost report.
		p := live[rand.IntN(len(live))]
		kill := action%2 == 0
		if kill {
			p.killed = true
			_ = p.cmd.Process.Kill()
		} else {
			_ = p.cmd.Process.Signal(syscall.SIGSTOP)
			p.chaosPaused = true
		}
		r.mu.Unlock()
		if kill {
			<-p.done
			kills++
			if _, err := r.start(); err != nil {
				t.Fatal(err)
			}
			continue
		}
		time.Sleep(r.ttl + rand.N(r.ttl))
		r.mu.Lock()
		p.chaosPaused = false
		if p.traps == 0 {
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
		}
		r.mu.Unlock()
		pauses++
	}

	// Every process drains the queue and exits (a process started meanwhile
	// to take trapped jobs over included).
	drainDeadline := time.After(90*time.Second + 4000*rtt)
	for waited := 0; ; {
		r.mu.Lock()
		procs := append([]*importerProc(nil), r.procs...)
		r.mu.Unlock()
		if waited == len(procs) {
			break
		}
		for _, p := range procs[waited:] {
			select {
			case <-p.done:
			case err := <-trapErrs:
				t.Fatal(err)
			case <-drainDeadline:
				t.Fatalf("%s import: workers still running after the drain deadline; %d jobs unfinished", mode, unfinished())
			}
		}
		waited = len(procs)
	}
	elapsed := time.Since(start)
	stopTraps()
	trapWG.Wait()
	select {
	case err := <-trapErrs:
		t.Fatal(err)
	default:
	}

	// The history of every process, killed ones included. A process journals
	// a claim when the job's handler starts: the jobs a killed process had
	// claimed and not yet handled have no claim in its journal, though their
	// claims superseded the one before (a holder paused past its claim then
	// finds its completion refused, correctly). So each killed process may
	// have claimed any job, any time after it started, with a token nobody
	// knows: an open claim per job, as history records a cut claim.
	r.mu.Lock()
	for _, p := range r.procs {
		if err := r.rec.ReadJournal(filepath.Join(r.journals, p.name)); err != nil {
			t.Fatal(err)
		}
		if !p.killed {
			continue
		}
		for _, j := range enqueued {
			r.rec.Add(history.Op{Client: r.rec.Client(), Input: history.Input{Kind: history.Claim, Key: history.JobKey(j), Holder: p.name, TTL: r.ttl},
				Output: history.Output{Outcome: history.Unknown}, Call: p.startedAt, Return: math.MaxInt64, ReturnWall: math.MaxInt64})
		}
	}
	r.mu.Unlock()
	r.rec.Verify(t)

	// What must hold in every mode.
	ds, err := skiplocked.QueueDepths(ctx, admin, queue)
	if err != nil {
		t.Fatalf("%s import: queue depth: %v", mode, err)
	}
	d := ds[0]
	if d.Completed != int64(jobs) || d.Unfinished() != 0 || d.Dead != 0 {
		t.Fatalf("%s import: queue depth %+v (%v), want all %d jobs completed", mode, d, err, jobs)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	fired := len(r.trapped)
	for _, e := range r.errs {
		t.Errorf("%s import: unexpected worker output: %s", mode, e)
	}
	out := importOutcome{jobs: jobs, traps: fired, pauses: pauses, kills: kills, procs: r.started, lost: len(r.lost), elapsed: elapsed}
	for _, p := range r.procs {
		if p.killed {
			continue
		}
		if p.exitErr != nil || p.summary == nil {
			t.Errorf("%s import: worker %s ended with %v and no summary", mode, p.name, p.exitErr)
			continue
		}
		// Unknown outcomes are allowed: a worker paused past the deadline of
		// an outcome write gives up on it (the claim expires, the job runs
		// again). Each loss it counted must have reached OnClaimLost.
		if p.summary["lost"] != p.lost {
			t.Errorf("%s import: worker %s: summary %v, but %d losses reached OnClaimLost", mode, p.name, p.summary, p.lost)
		}
		out.unknown += p.summary["unknown"]
	}
	if fired != traps {
		t.Errorf("%s import: %d traps fired, want %d", mode, fired, traps)
	}
	// Every loss reported is real: the job was claimed again after the
	// token that lost it. A report for the token the job was completed
	// under would be a false one.
	finalTok := map[int64]int64{}
	rows, err := admin.Query(ctx, "SELECT id, claim_token FROM pgfence.jobs WHERE queue = $1", queue)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id, tok int64
		if err := rows.Scan(&id, &tok); err != nil {
			t.Fatal(err)
		}
		finalTok[id] = tok
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	for _, l := range r.lost {
		if finalTok[l.job] <= l.token || (l.current != 0 && l.current <= l.token) {
			out.falseLost++
			t.Errorf("%s import: false claim-lost report from %s: job %d token %d (reported current %d, %s), final token %d",
				mode, l.proc, l.job, l.token, l.current, l.state, finalTok[l.job])
		}
	}
	// Every trapped worker accounts for its stopped claim: it reports the
	// loss, or (on a loaded machine, when the refused completion could not
	// be written within its deadline) counts the outcome as unknown, never
	// applied: the claim had already been taken over.
	unreported := map[*importerProc][]int64{}
	for id, tok := range r.trapped {
		found := false
		for _, l := range r.lost {
			found = found || (l.job == id && l.token == tok)
		}
		if !found {
			p := r.trapper[id]
			unreported[p] = append(unreported[p], id)
		}
	}
	for p, jobs := range unreported {
		if p.summary == nil || p.summary["unknown"] < len(jobs) {
			t.Errorf("%s import: the worker %s trapped on jobs %v reported no lost claim for them (summary %v)", mode, p.name, jobs, p.summary)
			continue
		}
		t.Logf("%s import: the worker %s trapped on jobs %v counted their outcomes as unknown (summary %v)", mode, p.name, jobs, p.summary)
	}
	if err := admin.QueryRow(ctx, `
		SELECT count(*), count(*) - count(DISTINCT i.job_id),
		       count(DISTINCT i.job_id) FILTER (WHERE i.job_id IN (SELECT job_id FROM imported GROUP BY job_id HAVING count(*) > 1)),
		       count(*) FILTER (WHERE i.token <> j.claim_token)
		FROM imported i JOIN pgfence.jobs j ON j.id = i.job_id`).Scan(&out.effects, &out.duplicates, &out.dupJobs, &out.staleToks); err != nil {
		t.Fatal(err)
	}
	var missing int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM pgfence.jobs j WHERE NOT EXISTS (SELECT 1 FROM imported i WHERE i.job_id = j.id)").Scan(&missing); err != nil {
		t.Fatal(err)
	}
	if missing != 0 {
		t.Errorf("%s import: %d completed jobs have no effect", mode, missing)
	}
	if kills == 0 || pauses == 0 {
		t.Errorf("%s import: the run did not exercise the faults: %d kills, %d pauses", mode, kills, pauses)
	}
	t.Logf("%s import: %d jobs, %d worker processes (%d killed, %d paused past the claim by the chaos loop, %d trapped between effect and completion), "+
		"%d effects, %d duplicate effects on %d jobs, %d effects under a superseded token, %d lost claims reported (%d false), "+
		"%d outcomes given up by paused workers, %v (round trip %v, claim TTL %v)",
		mode, jobs, out.procs, kills, pauses, fired, out.effects, out.duplicates, out.dupJobs, out.staleToks, out.lost, out.falseLost,
		out.unknown,
		elapsed.Round(time.Millisecond), rtt.Round(time.Microsecond), r.ttl)
	return out
}

// TestImporterExactlyOnce imports 2,000 jobs twice, with four worker
// processes each, while workers are paused (SIGSTOP) past their claim and
// killed (SIGKILL) and replaced; in each import eight workers are stopped
// right between a job's effect and its completion until another worker has
// re-claimed and completed that job. With the exactly-once mode
// (skiplocked.NewTxWorker: effect and completion in one transaction) every
// job has exactly one effect, written under the claim that completed it; with
// the effect committed on its own before the completion (skiplocked.NewWorker)
// every trapped job has a duplicate effect: the mode matters. In both, every
// job ends completed, every trapped worker's completion is refused and
// reported to OnClaimLost, and no report is false (each names a token the job
// was claimed again after).
func TestImporterExactlyOnce(t *testing.T) {
	t.Parallel()
	const jobs, traps = 2000, 8
	var tx, auto importOutcome
	t.Run("modes", func(t *testing.T) {
		t.Run(modeTx, func(t *testing.T) {
			t.Parallel()
			tx = runImport(t, modeTx, jobs, traps)
			if tx.duplicates != 0 || tx.staleToks != 0 || tx.effects != jobs {
				t.Errorf("exactly-once mode: %d effects, %d duplicates, %d under a superseded token; want %d, 0, 0",
					tx.effects, tx.duplicates, tx.staleToks, jobs)
			}
		})
		t.Run(modeAutocommit, func(t *testing.T) {
			t.Parallel()
			auto = runImport(t, modeAutocommit, jobs, traps)
		})
	})
	if t.Failed() {
		return
	}
	if auto.dupJobs < traps || auto.duplicates < traps {
		t.Errorf("effects committed before the completion: %d duplicate effects on %d jobs, want at least one per trap (%d): "+
			"the test no longer shows that the mode matters", auto.duplicates, auto.dupJobs, traps)
	}
	t.Logf("importer under pauses and kills, %d jobs per mode: exactly-once (NewTxWorker) %d duplicate effects, %d false claim-lost reports; "+
		"effect committed before the completion (NewWorker) %d duplicate effects on %d jobs, %d false claim-lost reports",
		jobs, tx.duplicates, tx.falseLost, auto.duplicates, auto.dupJobs, auto.falseLost)
}
