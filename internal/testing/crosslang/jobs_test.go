package crosslang

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/skiplocked"
)

const (
	jobQueue     = "crosslang"
	effectsTable = "crosslang_effects"
	numJobs      = 300
	pyHolder     = "python-worker"
	goHolder     = "go-worker"
)

// claimRef is a job id and the claim token a worker held it under.
type claimRef struct{ id, token int64 }

func parseRef(t *testing.T, id, token string) claimRef {
	t.Helper()
	i, err1 := strconv.ParseInt(id, 10, 64)
	k, err2 := strconv.ParseInt(token, 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	return claimRef{i, k}
}

// TestPythonAndGoDrainOneQueue: a Python job worker process and Go's
// skiplocked TxWorker drain one queue of 300 jobs together (every tenth job
// fails its first attempt). Each records a job's effect, a row (job id,
// claim token, who), in the transaction that completes the job, so the
// effect commits only if the completion was accepted. The Python worker is
// stopped with SIGSTOP while it holds its third claim, until the Go worker
// has claimed every job of it again after its claim TTL; resumed, it tries
// to complete them. Every job ends completed with exactly one effect, under
// the token of its last claim and by its last holder, and no completion by
// the stale worker is accepted.
func TestPythonAndGoDrainOneQueue(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	py := python(t)
	admin, roleDSN := setup(t, ctx,
		`CREATE TABLE `+effectsTable+` (job_id bigint NOT NULL, claim_token bigint NOT NULL, who text NOT NULL)`,
		"GRANT SELECT, INSERT ON "+effectsTable+" TO %s")
	ps := make([]skiplocked.EnqueueParams, numJobs)
	for i := range ps {
		ps[i] = skiplocked.EnqueueParams{Queue: jobQueue, Payload: json.RawMessage(fmt.Sprintf(`{"n": %d, "fail_once": %v}`, i, i%10 == 0))}
	}
	if _, err := skiplocked.Enqueue(ctx, admin, ps...); err != nil {
		t.Fatal(err)
	}

	pyw := startProc(t, "python job worker", nil, py.exe, clientPath(t), "job-worker", "--dsn", roleDSN,
		"--queue", jobQueue, "--holder", pyHolder, "--ttl-ms", "300", "--batch", "5", "--effects", effectsTable, "--hold", "3")
	var pyLines []string
	l, before := pyw.expect("done ", lineWait) // the Python worker is at work: start the Go one
	pyLines = append(append(pyLines, before...), l)

	app := pgtest.PoolFor(t, withParam(t, roleDSN, "pool_max_conns", "8"))
	gow, err := skiplocked.NewTxWorker(app, jobQueue, func(ctx context.Context, tx pgx.Tx, job skiplocked.Job) error {
		var p struct {
			FailOnce bool `json:"fail_once"`
		}
		if err := json.Unmarshal(job.Payload, &p); err != nil {
			return skiplocked.Permanent(err)
		}
		if p.FailOnce && job.Attempts == 1 {
			return errors.New("first attempt fails")
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+effectsTable+" (job_id, claim_token, who) VALUES ($1, $2, $3)",
			job.ID, job.ClaimToken, goHolder)
		return err
	}, &skiplocked.Config{Holder: goHolder, Concurrency: 2, PollInterval: 20 * time.Millisecond,
		Backoff: func(int) time.Duration { return time.Millisecond }})
	if err != nil {
		t.Fatal(err)
	}
	type drained struct {
		s   skiplocked.Summary
		err error
	}
	goDone := make(chan drained, 1)
	go func() {
		s, err := gow.Drain(ctx)
		goDone <- drained{s, err}
	}()
	defer func() { // on a failure: stop the Go worker before the pool closes
		cancel()
		<-goDone
	}()

	l, before = pyw.expect("held ", lineWait)
	pyLines = append(append(pyLines, before...), l)
	pyw.stop()
	pyw.send("") // read when resumed: handle the held claim
	var held []claimRef
	for _, f := range strings.Split(strings.TrimPrefix(l, "held "), ",") {
		id, token, _ := strings.Cut(f, ":")
		held = append(held, parseRef(t, id, token))
	}
	pollUntil(t, ctx, 2*time.Minute, "the Go worker claims the stopped worker's jobs again", func() (bool, error) {
		for _, h := range held {
			var token int64
			var holder string
			if err := admin.QueryRow(ctx, "SELECT claim_token, holder FROM pgfence.jobs WHERE id = $1", h.id).Scan(&token, &holder); err != nil {
				return false, err
			}
			if token == h.token || holder != goHolder {
				return false, nil
			}
		}
		return true, nil
	})
	pyw.signal(syscall.SIGCONT)
	l, before = pyw.expect("drained", 2*time.Minute)
	pyLines = append(append(pyLines, before...), l)
	pyw.wait(lineWait)
	var d drained
	select {
	case d = <-goDone:
		goDone <- d // for the deferred receive
	case <-ctx.Done():
		t.Fatal("the Go worker did not drain the queue")
	}
	if d.err != nil {
		t.Fatal(d.err)
	}

	var pyDone, pyStale, pyFailed []claimRef
	for _, l := range pyLines {
		f := strings.Fields(l)
		switch {
		case len(f) == 3 && f[0] == "done":
			pyDone = append(pyDone, parseRef(t, f[1], f[2]))
		case len(f) == 3 && f[0] == "stale":
			pyStale = append(pyStale, parseRef(t, f[1], f[2]))
		case len(f) == 3 && f[0] == "failed":
			pyFailed = append(pyFailed, parseRef(t, f[1], f[2]))
		case len(f) == 2 && f[0] == "held", l == "drained":
		default:
			t.Errorf("python job worker: unexpected line %q", l)
		}
	}
	stale := map[claimRef]bool{}
	for _, s := range pyStale {
		stale[s] = true
	}
	for _, h := range held {
		if !stale[h] {
			t.Errorf("held claim %v (taken over while the Python worker was stopped) was not refused", h)
		}
	}

	var effects, distinct, completed, wrongClaim, staleAccepted, pyEffects, goEffects int
	if err := admin.QueryRow(ctx, "SELECT count(*), count(DISTINCT job_id), count(*) FILTER (WHERE who = $1), "+
		"count(*) FILTER (WHERE who = $2) FROM "+effectsTable, pyHolder, goHolder).Scan(&effects, &distinct, &pyEffects, &goEffects); err != nil {
		t.Fatal(err)
	}
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM pgfence.jobs WHERE queue = $1 AND state = 'completed'", jobQueue).Scan(&completed); err != nil {
		t.Fatal(err)
	}
	// An effect under any claim but the job's last, or by another holder,
	// is a stale completion that was accepted.
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM "+effectsTable+" e JOIN pgfence.jobs j ON j.id = e.job_id "+
		"WHERE e.claim_token <> j.claim_token OR e.who <> j.holder OR j.state <> 'completed'").Scan(&wrongClaim); err != nil {
		t.Fatal(err)
	}
	ids, tokens := make([]int64, len(pyStale)), make([]int64, len(pyStale))
	for i, s := range pyStale {
		ids[i], tokens[i] = s.id, s.token
	}
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM "+effectsTable+" e JOIN unnest($1::bigint[], $2::bigint[]) AS s(id, token) "+
		"ON e.job_id = s.id AND e.claim_token = s.token", ids, tokens).Scan(&staleAccepted); err != nil {
		t.Fatal(err)
	}
	twice := effects - distinct
	switch {
	case effects != numJobs || distinct != numJobs || completed != numJobs:
		t.Errorf("%d effects of %d distinct jobs, %d jobs completed; want %d of each", effects, distinct, completed, numJobs)
	case twice != 0 || wrongClaim != 0 || staleAccepted != 0:
		t.Errorf("%d jobs done twice, %d effects not of the job's last claim, %d stale completions accepted", twice, wrongClaim, staleAccepted)
	}
	if len(pyStale) == 0 || len(pyDone) == 0 || d.s.Completed == 0 {
		t.Errorf("python: %d done, %d stale; go: %d completed: both must work and the stopped worker must be refused",
			len(pyDone), len(pyStale), d.s.Completed)
	}
	if pyEffects != len(pyDone) || int64(goEffects) != d.s.Completed {
		t.Errorf("effects by python %d, by go %d; the workers said %d and %d", pyEffects, goEffects, len(pyDone), d.s.Completed)
	}
	t.Logf("Python %s, psycopg %s; %d jobs: done once %d (python %d, go %d), done twice %d; python failed %d first attempts, "+
		"go %+v; held claim of %d jobs taken over while stopped; stale completions attempted %d, accepted %d",
		py.version, py.psycopg, numJobs, distinct, pyEffects, goEffects, twice, len(pyFailed), d.s, len(held), len(pyStale), staleAccepted)
}
