package faultsuite

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/outbox"
	"github.com/pgfence/pgfence/pglock"
)

// Environment of the outbox test's child processes (this test binary
// started again): a lock holder that records an intent, or a dispatcher.
const (
	envOutboxHolder     = "PGFENCE_OUTBOX_HOLDER"     // holder mode: before (pause before Enqueue) or inside (before COMMIT)
	envOutboxDispatcher = "PGFENCE_OUTBOX_DISPATCHER" // dispatcher name
	envOutboxDSN        = "PGFENCE_OUTBOX_DSN"
	envOutboxLock       = "PGFENCE_OUTBOX_LOCK"
	envOutboxKey        = "PGFENCE_OUTBOX_KEY"
	envOutboxTTL        = "PGFENCE_OUTBOX_TTL"
	envOutboxURL        = "PGFENCE_OUTBOX_URL"
	envOutboxHTTP       = "PGFENCE_OUTBOX_HTTP_TIMEOUT"
)

const outboxTopic = "payments"

func init() {
	if mode := os.Getenv(envOutboxHolder); mode != "" {
		os.Exit(outboxHolderMain(mode))
	}
	if name := os.Getenv(envOutboxDispatcher); name != "" {
		os.Exit(outboxDispatcherMain(name))
	}
}

// outboxHolderMain takes the lease, prints "granted TOKEN" and, in one
// transaction, writes a settlement row and records a payment intent. It
// waits for a line on stdin before the Enqueue (mode before) or before the
// COMMIT (mode inside, after printing "enqueued"); the parent stops it there
// (SIGSTOP) past its lease. It prints how the intent ended: "recorded",
// "refused-enqueue TOKEN LATEST" or "refused-commit TOKEN LATEST".
func outboxHolderMain(mode string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fail := func(err error) int {
		fmt.Printf("error %s\n", strings.Join(strings.Fields(err.Error()), " "))
		return 1
	}
	ttl, err := time.ParseDuration(os.Getenv(envOutboxTTL))
	if err != nil {
		return fail(err)
	}
	pool, err := pgxpool.New(ctx, os.Getenv(envOutboxDSN))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	locker, err := pglock.New(pool, &pglock.Config{Holder: fmt.Sprintf("old/%d", os.Getpid())})
	if err != nil {
		return fail(err)
	}
	defer locker.Close()
	rec, err := history.FromEnv()
	if err != nil || rec == nil {
		return fail(fmt.Errorf("no history journal: %v", err))
	}
	c := rec.NewClient()
	// The transaction's connection first: opening one after the grant
	// (a new connection on a busy machine) could outlast the lease before
	// the parent stops this process, and the scenario would not happen.
	tx, err := pool.Begin(ctx)
	if err != nil {
		return fail(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	lease, err := c.Acquire(ctx, locker, os.Getenv(envOutboxLock), ttl, true)
	for retry := 0; errors.Is(err, pgfence.ErrSlowGrant) && retry < 5; retry++ {
		lease, err = c.Acquire(ctx, locker, os.Getenv(envOutboxLock), ttl, true)
	}
	if err != nil {
		return fail(err)
	}
	stdin := bufio.NewScanner(os.Stdin)
	fmt.Printf("granted %d\n", lease.Token())
	if _, err := tx.Exec(ctx, "INSERT INTO settlements (key, token) VALUES ($1, $2)", os.Getenv(envOutboxKey), lease.Token()); err != nil {
		return fail(err)
	}
	if mode == "before" {
		stdin.Scan()
	}
	in := outbox.Intent{Topic: outboxTopic, Key: os.Getenv(envOutboxKey), Payload: json.RawMessage(`{"amount":100}`)}
	var refused *pgfence.Error
	at := "enqueue"
	err = c.Enqueued(lease.Name(), lease.Token(), in.Key, func() error {
		if _, err := outbox.Enqueue(ctx, tx, lease, in); err != nil {
			return err
		}
		if mode == "inside" {
			fmt.Println("enqueued")
			stdin.Scan()
		}
		at = "commit"
		return tx.Commit(ctx)
	})
	var pgErr *pgconn.PgError // the server's DETAIL: the lock's latest token
	if errors.As(err, &refused) && errors.Is(err, pgfence.ErrStaleToken) && errors.As(refused.Err, &pgErr) {
		_, latest, _, _ := pgerr.ParseRefusal(pgErr.Detail)
		fmt.Printf("refused-%s %d %d\n", at, refused.Token, latest)
		return 0
	}
	if err != nil {
		return fail(err)
	}
	fmt.Println("recorded")
	return 0
}

// outboxApp is the application_name of a dispatcher process's sessions.
func outboxApp(name string) string { return "faults-outbox-" + name }

// outboxDispatcherMain runs an outbox.Dispatcher of topic payments with the
// HTTP helper until SIGTERM (or until it is killed).
func outboxDispatcherMain(name string) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute) // an orphan ends on its own
	defer cancel()
	fail := func(err error) int {
		fmt.Printf("error %s\n", strings.Join(strings.Fields(err.Error()), " "))
		return 1
	}
	ttl, err := time.ParseDuration(os.Getenv(envOutboxTTL))
	if err != nil {
		return fail(err)
	}
	httpTimeout, err := time.ParseDuration(os.Getenv(envOutboxHTTP))
	if err != nil {
		return fail(err)
	}
	cfg, err := pgxpool.ParseConfig(os.Getenv(envOutboxDSN))
	if err != nil {
		return fail(err)
	}
	cfg.MaxConns = 6
	cfg.ConnConfig.RuntimeParams["application_name"] = outboxApp(name)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	h, err := outbox.NewHTTPHandler(outbox.HTTPConfig{URL: os.Getenv(envOutboxURL), Timeout: httpTimeout})
	if err != nil {
		return fail(err)
	}
	d, err := outbox.NewDispatcher(pool, outboxTopic, h, &outbox.Config{
		Holder: fmt.Sprintf("%s/%d", name, os.Getpid()), Concurrency: 4, ClaimTTL: ttl, PollInterval: 50 * time.Millisecond,
		Backoff: func(int) time.Duration { return 10*time.Millisecond + rand.N(40*time.Millisecond) },
	})
	if err != nil {
		return fail(err)
	}
	fmt.Println("ready")
	if err := d.Run(ctx); err != nil {
		return fail(err)
	}
	s := d.Summary()
	fmt.Printf("summary claimed=%d delivered=%d failed=%d dead=%d lost=%d\n", s.Claimed, s.Completed, s.Failed, s.Dead, s.ClaimsLost)
	return 0
}

// childProc is a child process with its stdout as lines.
type childProc struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	done  chan struct{}
}

func startChild(t *testing.T, env ...string) *childProc {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &childProc{cmd: cmd, stdin: stdin, lines: make(chan string, 64), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			select {
			case p.lines <- sc.Text():
			default: // nobody reads (a dispatcher's summary): drop
			}
		}
		_ = cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		<-p.done
	})
	return p
}

// next returns the child's next line, failing the test after timeout.
func (p *childProc) next(t *testing.T, timeout time.Duration) string {
	t.Helper()
	select {
	case l := <-p.lines:
		if strings.HasPrefix(l, "error ") {
			t.Fatalf("child: %s", l)
		}
		return l
	case <-p.done:
		select {
		case l := <-p.lines:
			return l
		default:
		}
		t.Fatal("child ended without a line")
	case <-time.After(timeout):
		t.Fatalf("child silent for %v", timeout)
	}
	return ""
}

// receiver is the receiving HTTP server: it applies each idempotency key's
// effect once and answers a repeated key with 200 without applying it again.
// When flaky, it sometimes answers 500 or hangs (until the client gives
// up), before or after applying the effect.
type receiver struct {
	mu       sync.Mutex
	flaky    bool
	applied  map[string]int   // effects per key
	requests map[string]int   // requests per key
	tokens   map[string]int64 // token of the applied request
	dedup    int              // requests for a key already applied
	fails    int              // 500 answers
	hangs    int              // requests left hanging
}

func newReceiver(flaky bool) *receiver {
	return &receiver{flaky: flaky, applied: map[string]int{}, requests: map[string]int{}, tokens: map[string]int64{}}
}

func (rc *receiver) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	tok, _ := strconv.ParseInt(r.Header.Get("Pgfence-Token"), 10, 64)
	_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 1<<20))
	roll := rand.IntN(100)
	if !rc.flaky {
		roll = 99
	}
	hang := func() {
		rc.mu.Lock()
		rc.hangs++
		rc.mu.Unlock()
		select {
		case <-r.Context().Done():
		case <-time.After(time.Minute):
		}
	}
	fail := func() {
		rc.mu.Lock()
		rc.fails++
		rc.mu.Unlock()
		w.WriteHeader(http.StatusInternalServerError)
	}
	switch {
	case roll < 3:
		hang()
		return
	case roll < 9:
		fail()
		return
	}
	rc.mu.Lock()
	rc.requests[key]++
	if rc.applied[key] > 0 {
		rc.dedup++
	} else {
		rc.applied[key]++
		rc.tokens[key] = tok
	}
	rc.mu.Unlock()
	switch {
	case roll < 12: // applied, but the answer is lost
		hang()
	case roll < 17:
		fail()
	default:
		w.WriteHeader(http.StatusOK)
	}
}

// TestOutboxPausedHolder stops a lock holder (a real process, SIGSTOP) past
// its lease, either before it records its payment intent or after recording
// it but before its COMMIT, while a new holder takes the lock and records its
// own intent for the same settlement. When the old holder resumes, its intent
// is refused with the stale-token error of a fenced write (at Enqueue, or at
// COMMIT), nothing of its transaction is recorded, and only the new holder's
// intent reaches the receiver.
func TestOutboxPausedHolder(t *testing.T) {
	t.Parallel()
	modes := []string{"before", "inside"}
	rounds := 2
	if long() {
		rounds = 20
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute+time.Duration(rounds*len(modes))*20*time.Second)
	defer cancel()
	dsn := pgtest.DSN(t)
	admin := appPool(t, dsn, appAdmin, 4)
	if _, err := admin.Exec(ctx, "CREATE TABLE settlements (key text PRIMARY KEY, token bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	// The new holder polls often: its grant should follow the old lease's
	// expiry closely (the wait itself is on the database's clock).
	locker, err := pglock.New(admin, &pglock.Config{Holder: "new", PollInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	rc := newReceiver(false)
	srv := httptest.NewServer(rc)
	defer srv.Close()

	// Long enough for the old holder's two statements between its grant
	// and the pause on a busy machine; the new holder waits it out once
	// per round.
	const ttl = time.Second
	want := map[string]int64{}
	stale := map[string]bool{}
	rec := history.New()
	nc := rec.NewClient()
	journals := t.TempDir()
	for i := range rounds * len(modes) {
		mode := modes[i%len(modes)]
		lock := fmt.Sprintf("settle:store-%d", i)
		oldKey, newKey := fmt.Sprintf("settle:%d:old", i), fmt.Sprintf("settle:%d:new", i)
		p := startChild(t, envOutboxHolder+"="+mode, envOutboxDSN+"="+dsn, envOutboxLock+"="+lock, envOutboxKey+"="+oldKey,
			envOutboxTTL+"="+ttl.String(), rec.JournalEnv(filepath.Join(journals, fmt.Sprint(i)), 1000*(i+1)))
		l := p.next(t, time.Minute)
		oldTok, err := strconv.ParseInt(strings.TrimPrefix(l, "granted "), 10, 64)
		if err != nil {
			t.Fatalf("holder: %q", l)
		}
		if mode == "inside" {
			if l := p.next(t, time.Minute); l != "enqueued" {
				t.Fatalf("holder: %q, want enqueued", l)
			}
		}
		if err := p.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		// The old holder's lease runs out on the database's clock; the new
		// holder waits for it (Acquire blocks until the lock is free). The
		// stopped holder's open transaction does not hold the grant back.
		lease, err := nc.Acquire(ctx, locker, lock, time.Minute, true)
		if err != nil {
			t.Fatal(err)
		}
		if lease.Token() <= oldTok {
			t.Fatalf("new grant %d after %d", lease.Token(), oldTok)
		}
		enqCall := rec.Now()
		err = pgx.BeginFunc(ctx, admin, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "INSERT INTO settlements (key, token) VALUES ($1, $2)", newKey, lease.Token()); err != nil {
				return err
			}
			_, err := outbox.Enqueue(ctx, tx, lease, outbox.Intent{Topic: outboxTopic, Key: newKey,
				Payload: json.RawMessage(`{"amount":100}`)})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		rec.Add(history.Op{Client: nc.ID(), Input: history.Input{Kind: history.Enqueue, Key: lock, Token: lease.Token(), Value: newKey},
			Output: history.Output{Outcome: history.OK}, Call: enqCall, Return: rec.Now()})
		want[newKey] = lease.Token()
		stale[oldKey] = true
		if _, err := io.WriteString(p.stdin, "go\n"); err != nil {
			t.Fatal(err)
		}
		if err := p.cmd.Process.Signal(syscall.SIGCONT); err != nil {
			t.Fatal(err)
		}
		end := p.next(t, time.Minute)
		wantEnd := map[string]string{"before": "refused-enqueue", "inside": "refused-commit"}[mode]
		if end != fmt.Sprintf("%s %d %d", wantEnd, oldTok, lease.Token()) {
			t.Fatalf("round %d (%s): the old holder (token %d) ended with %q, want %s %d %d", i, mode, oldTok, end, wantEnd, oldTok, lease.Token())
		}
		if err := nc.Release(ctx, lease); err != nil {
			t.Fatal(err)
		}
		if err := rec.ReadJournal(filepath.Join(journals, fmt.Sprint(i))); err != nil {
			t.Fatal(err)
		}
	}
	rec.Verify(t)
	var n int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM settlements WHERE key LIKE '%:old'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d settlement rows of stale holders committed (%v)", n, err)
	}
	h, err := outbox.NewHTTPHandler(outbox.HTTPConfig{URL: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	d, err := outbox.NewDispatcher(admin, outboxTopic, h, &outbox.Config{PollInterval: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	for key, tok := range want {
		if rc.applied[key] != 1 || rc.tokens[key] != tok {
			t.Errorf("new holder's intent %s: applied %d times with token %d, want once with %d", key, rc.applied[key], rc.tokens[key], tok)
		}
	}
	for key := range rc.requests {
		if stale[key] {
			t.Errorf("stale holder's intent %s was delivered", key)
		}
	}
	if len(rc.applied) != len(want) {
		t.Errorf("%d effects, want %d", len(rc.applied), len(want))
	}
	t.Logf("paused holder: %d rounds (stopped before Enqueue, and between Enqueue and COMMIT): %d stale intents refused, "+
		"0 recorded, %d intents of new holders delivered", len(stale), len(stale), len(want))
}

// TestOutboxFaults records payment intents in batches, from holders of
// several locks, while dispatcher processes deliver them over HTTP to a
// receiver that sometimes answers 500 or hangs (before or after applying the
// effect), and a chaos loop kills dispatchers (SIGKILL), stops them past
// their claim (SIGSTOP) and terminates their backends. Superseded holders
// try to record intents too. Every recorded intent must take effect at the
// receiver exactly once (by key), no refused intent may reach it, and a
// repeated Enqueue of a recorded key must report the first intent.
func TestOutboxFaults(t *testing.T) {
	t.Parallel()
	intents := 240
	if long() {
		intents = 1200
	}
	const perBatch = 10
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dsn := pgtest.DSN(t)
	admin := appPool(t, dsn, appAdmin, 6)
	if _, err := admin.Exec(ctx, "CREATE TABLE settlements (key text PRIMARY KEY, token bigint NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	// Round trips on this machine now (the median of 21): the claim TTL,
	// the HTTP timeout and the waits are scaled from it.
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
	ttl := time.Second + 100*rtt
	httpTimeout := 300*time.Millisecond + 50*rtt

	rc := newReceiver(true)
	srv := httptest.NewServer(rc)
	defer srv.Close()

	var mu sync.Mutex
	var procs []*childProc
	started := 0
	start := func() {
		mu.Lock()
		started++
		name := fmt.Sprintf("d%d", started)
		mu.Unlock()
		p := startChild(t, envOutboxDispatcher+"="+name, envOutboxDSN+"="+dsn, envOutboxURL+"="+srv.URL+"/pay",
			envOutboxTTL+"="+ttl.String(), envOutboxHTTP+"="+httpTimeout.String())
		mu.Lock()
		procs = append(procs, p)
		mu.Unlock()
	}
	for range 3 {
		start()
	}

	// The producer: batches of intents, each in the transaction of its
	// settlement rows, under the lease of one of four locks. Every fifth
	// batch, a superseded holder tries to record an intent (refused at
	// Enqueue or at COMMIT); every third, a recorded key is enqueued again.
	locker, err := pglock.New(admin, &pglock.Config{Holder: "producer"})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	recorded := map[string]int64{}
	// The producer's leases and intents are recorded and checked: each
	// intent accepted only under the lock's current token.
	rec := history.New()
	pc, sc := rec.NewClient(), rec.NewClient()
	var staleKeys []string
	var duplicates int
	produce := func(b int) error {
		lock := fmt.Sprintf("settle:store-%d", b%4)
		lease, err := pc.Acquire(ctx, locker, lock, time.Minute, true)
		if err != nil {
			return err
		}
		keys := make([]string, perBatch)
		batchCall := rec.Now()
		err = pgx.BeginFunc(ctx, admin, func(tx pgx.Tx) error {
			for i := range keys {
				keys[i] = fmt.Sprintf("settle:%d:%d", b, i)
				if _, err := tx.Exec(ctx, "INSERT INTO settlements (key, token) VALUES ($1, $2)", keys[i], lease.Token()); err != nil {
					return err
				}
				r, err := outbox.Enqueue(ctx, tx, lease, outbox.Intent{Topic: outboxTopic, Key: keys[i],
					Payload: json.RawMessage(fmt.Sprintf(`{"batch":%d,"item":%d}`, b, i)), MaxAttempts: 1000})
				if err != nil || r.Duplicate {
					return fmt.Errorf("enqueue %s: %+v, %w", keys[i], r, err)
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, k := range keys {
			recorded[k] = lease.Token()
			rec.Add(history.Op{Client: pc.ID(), Input: history.Input{Kind: history.Enqueue, Key: lock, Token: lease.Token(), Value: k},
				Output: history.Output{Outcome: history.OK}, Call: batchCall, Return: rec.Now()})
		}
		if b%3 == 2 {
			again := keys[0] // keys are unique per lock: a key this lock recorded
			var r outbox.Result
			err := pc.Enqueued(lock, lease.Token(), again, func() error {
				var err error
				r, err = outbox.Enqueue(ctx, admin, lease, outbox.Intent{Topic: outboxTopic, Key: again,
					Payload: json.RawMessage(`{"again":true}`)})
				return err
			})
			if err != nil || !r.Duplicate {
				return fmt.Errorf("enqueue of recorded key %s again: %+v, %v; want a duplicate", again, r, err)
			}
			duplicates++
		}
		if b%5 == 4 {
			// A superseded holder: one intent refused at Enqueue, one at COMMIT.
			tx, err := admin.Begin(ctx)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctx) }()
			// The intent refused at COMMIT is one operation from its
			// Enqueue to the COMMIT, by a client of its own.
			atCommit := fmt.Sprintf("stale:%d:commit", b)
			commitCall := rec.Now()
			if _, err := outbox.Enqueue(ctx, tx, lease, outbox.Intent{Topic: outboxTopic, Key: atCommit,
				Payload: json.RawMessage(`{}`)}); err != nil {
				return err
			}
			if err := pc.Release(ctx, lease); err != nil {
				return err
			}
			next, err := pc.Acquire(ctx, locker, lock, time.Minute, true)
			if err != nil {
				return err
			}
			atEnqueue := fmt.Sprintf("stale:%d:enqueue", b)
			err = pc.Enqueued(lock, lease.Token(), atEnqueue, func() error {
				_, err := outbox.Enqueue(ctx, admin, lease, outbox.Intent{Topic: outboxTopic, Key: atEnqueue,
					Payload: json.RawMessage(`{}`)})
				return err
			})
			if !errors.Is(err, pgfence.ErrStaleToken) {
				return fmt.Errorf("superseded holder's Enqueue: %v, want a stale-token refusal", err)
			}
			if err := outbox.TranslateError(tx.Commit(ctx)); !errors.Is(err, pgfence.ErrStaleToken) {
				return fmt.Errorf("superseded holder's COMMIT: %v, want a stale-token refusal", err)
			}
			rec.Add(history.Op{Client: sc.ID(), Input: history.Input{Kind: history.Enqueue, Key: lock, Token: lease.Token(), Value: atCommit},
				Output: history.Output{Outcome: history.Stale}, Call: commitCall, Return: rec.Now()})
			staleKeys = append(staleKeys, atEnqueue, atCommit)
			lease = next
		}
		return pc.Release(ctx, lease)
	}
	prodErr := make(chan error, 1)
	go func() {
		for b := range intents / perBatch {
			if err := produce(b); err != nil {
				prodErr <- fmt.Errorf("batch %d: %w", b, err)
				return
			}
			time.Sleep(rand.N(20 * time.Millisecond))
		}
		prodErr <- nil
	}()

	undelivered := func() (left, dead int64) {
		st, err := outbox.Status(ctx, admin)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range st {
			left += s.Undelivered()
			dead += s.Dead
		}
		return left, dead
	}
	// Chaos until the producer is done and a tenth of the intents remain:
	// kill a dispatcher (and start another), stop one for one to two claim
	// TTLs, or terminate a dispatcher's backend, every 150-300 ms.
	kills, pauses, terminated := 0, 0, 0
	producing := true
	start0 := time.Now()
	for action := 0; ; action++ {
		select {
		case err := <-prodErr:
			if err != nil {
				t.Fatal(err)
			}
			producing = false
		case <-time.After(150*time.Millisecond + rand.N(150*time.Millisecond)):
		}
		if left, _ := undelivered(); !producing && left < int64(intents/10) {
			break
		}
		mu.Lock()
		var live []*childProc
		for _, p := range procs {
			select {
			case <-p.done:
			default:
				live = append(live, p)
			}
		}
		mu.Unlock()
		switch action % 3 {
		case 0:
			p := live[rand.IntN(len(live))]
			_ = p.cmd.Process.Kill()
			<-p.done
			kills++
			start()
		case 1:
			if len(live) < 2 {
				continue
			}
			p := live[rand.IntN(len(live))]
			_ = p.cmd.Process.Signal(syscall.SIGSTOP)
			time.Sleep(ttl + rand.N(ttl))
			_ = p.cmd.Process.Signal(syscall.SIGCONT)
			pauses++
		case 2:
			if ok, err := terminateOne(ctx, admin); err == nil && ok {
				terminated++
			}
		}
	}
	// Every intent delivered (or dead: none may be).
	deadline := time.Now().Add(60*time.Second + 2000*rtt)
	for {
		left, dead := undelivered()
		if dead != 0 {
			t.Fatalf("%d intents dead", dead)
		}
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d intents still undelivered after the deadline", left)
		}
		time.Sleep(50 * time.Millisecond)
	}
	elapsed := time.Since(start0)
	mu.Lock()
	for _, p := range procs {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	mu.Unlock()

	rc.mu.Lock()
	defer rc.mu.Unlock()
	lost, dupEffects, wrongTok, staleDelivered, deliveries := 0, 0, 0, 0, 0
	for key, tok := range recorded {
		switch n := rc.applied[key]; {
		case n == 0:
			lost++
			t.Errorf("intent %s was never applied", key)
		case n > 1:
			dupEffects++
			t.Errorf("intent %s applied %d times", key, n)
		}
		if rc.applied[key] > 0 && rc.tokens[key] != tok {
			wrongTok++
			t.Errorf("intent %s applied with token %d, recorded with %d", key, rc.tokens[key], tok)
		}
	}
	for _, key := range staleKeys {
		if rc.requests[key] > 0 {
			staleDelivered++
			t.Errorf("superseded holder's intent %s was delivered", key)
		}
	}
	for key, n := range rc.requests {
		deliveries += n
		if _, ok := recorded[key]; !ok && !slices.Contains(staleKeys, key) {
			t.Errorf("unknown key %s delivered", key)
		}
	}
	var rows, keys int
	if err := admin.QueryRow(ctx, "SELECT count(*), count(DISTINCT idempotency_key) FROM pgfence.outbox").Scan(&rows, &keys); err != nil {
		t.Fatal(err)
	}
	if rows != len(recorded) || keys != rows {
		t.Errorf("pgfence.outbox holds %d intents (%d keys), want %d", rows, keys, len(recorded))
	}
	if kills == 0 || pauses == 0 {
		t.Errorf("the run did not exercise the faults: %d kills, %d pauses", kills, pauses)
	}
	rec.Verify(t)
	t.Logf("outbox faults: %d intents recorded (%d repeated Enqueues reported as duplicates), %d intents of superseded holders refused; "+
		"%d dispatcher processes (%d killed, %d stopped past their claim), %d backends terminated; receiver: %d requests applied or deduplicated "+
		"(%d repeats absorbed by the key), %d answered 500, %d left hanging; "+
		"intents lost %d, duplicate effects %d, effects under another token %d, stale intents delivered %d; %v (round trip %v, claim TTL %v, HTTP timeout %v)",
		len(recorded), duplicates, len(staleKeys), started, kills, pauses, terminated, deliveries, rc.dedup, rc.fails, rc.hangs,
		lost, dupEffects, wrongTok, staleDelivered, elapsed.Round(time.Millisecond), rtt.Round(time.Microsecond), ttl, httpTimeout)
}
