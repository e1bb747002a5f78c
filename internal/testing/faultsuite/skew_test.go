package faultsuite

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

// Environment of a clock-skew worker process (this test binary started again
// under faketime).
const (
	envSkewWorker = "PGFENCE_SKEW_WORKER" // the faketime offset, e.g. "+1h"
	envSkewDSN    = "PGFENCE_SKEW_DSN"
)

// Lock names and timings of the clock-skew scenario.
const (
	skewHeldLock = "skew:held" // held by the parent (correct clock) for skewHeldTTL
	skewOwnLock  = "skew:own"  // taken by the skewed worker for skewOwnTTL
	skewHeldTTL  = 30 * time.Second
	skewOwnTTL   = 2 * time.Second
)

func init() {
	if off := os.Getenv(envSkewWorker); off != "" {
		os.Exit(skewWorkerMain(off))
	}
}

// skewWorkerMain is a client whose wall clock is off by offset ("+1h" or
// "-1h"). It is started under `faketime -f offset`. Go's runtime reads the
// clock through the vDSO, not through libc, so libfaketime (an LD_PRELOAD
// library) does not move time.Now; the worker measures what it got and, when
// the skew did not take, applies the offset itself to every wall-clock reading
// it uses for its own decisions (wall()). Each step prints one line; the
// parent checks them.
func skewWorkerMain(offset string) int {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fail := func(err error) int { fmt.Printf("error %v\n", err); return 1 }
	off, err := time.ParseDuration(strings.TrimPrefix(offset, "+"))
	if err != nil {
		return fail(err)
	}
	pool, err := pgxpool.New(ctx, os.Getenv(envSkewDSN))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()

	// How far off is this process's clock from the database's?
	var dbNow time.Time
	sent := time.Now()
	if err := pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&dbNow); err != nil {
		return fail(err)
	}
	goSkew := sent.Add(time.Since(sent) / 2).Sub(dbNow)
	libcSkew := "unknown"
	if out, err := exec.Command("date", "+%s").Output(); err == nil {
		if s, err := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64); err == nil {
			libcSkew = (time.Duration(s-time.Now().Unix()) * time.Second).String()
		}
	}
	simulated := time.Duration(0)
	if (goSkew - off).Abs() > 5*time.Minute {
		simulated = off // libfaketime did not reach Go's clock: skew it here
	}
	// wall is this client's wall clock: Round(0) drops the monotonic reading,
	// so comparisons with it use the (skewed) wall time, as a skewed host's
	// clock would.
	wall := func() time.Time { return time.Now().Round(0).Add(simulated) }
	fmt.Printf("clock go=%s libc-child=%s simulated=%s effective=%s\n",
		goSkew.Round(time.Second), libcSkew, simulated, wall().Sub(dbNow).Round(time.Second))

	locker, err := pglock.New(pool, &pglock.Config{Holder: "skewed" + offset, PollOnly: true})
	if err != nil {
		return fail(err)
	}
	defer locker.Close()
	// Every lease and write of this client goes into the parent's history.
	// The journal's clock is the parent's, carried over on the wall clock:
	// it needs Go's own clock unskewed (libfaketime does not reach it).
	if simulated == 0 {
		return fail(errors.New("libfaketime moved Go's clock: the history journal cannot be kept on the parent's clock"))
	}
	rec, err := history.FromEnv()
	if err != nil || rec == nil {
		return fail(fmt.Errorf("no history journal (%v)", err))
	}
	hc := rec.NewClient()
	table, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "skew_rows", Key: []string{"id"}, Set: []string{"v"}})
	if err != nil {
		return fail(err)
	}

	// 1. A lock the parent holds: by this client's clock it may look expired
	// (+1h); the database must still refuse to grant it.
	info, err := hc.Inspect(ctx, pool, skewHeldLock)
	if err != nil {
		return fail(err)
	}
	looksExpired := wall().After(info.ExpiresAt)
	res := "granted"
	if _, err := hc.Acquire(ctx, locker, skewHeldLock, time.Second, false); errors.Is(err, pgfence.ErrLocked) {
		res = "locked"
	} else if err != nil {
		return fail(err)
	}
	fmt.Printf("held looks-expired=%t tryacquire=%s\n", looksExpired, res)

	// 2. Its own lease: granted for the full TTL, whatever its clock says.
	lease, err := hc.Acquire(ctx, locker, skewOwnLock, skewOwnTTL, true)
	if err != nil {
		return fail(err)
	}
	start := time.Now()
	localLeft := time.Until(lease.Deadline())
	if err := skewWrite(ctx, hc, table, pool, lease.Token(), "worker"); err != nil {
		return fail(err)
	}
	fmt.Printf("own token=%d local-left-ms=%d wall-says-held=%t write=ok\n",
		lease.Token(), localLeft.Milliseconds(), wall().Before(lease.ExpiresAt()))

	// 3. The lease ends locally on the monotonic clock after at most the TTL,
	// even when this client's wall clock says it has an hour left (-1h).
	select {
	case <-lease.Done():
	case <-ctx.Done():
		return fail(errors.New("lease never ended locally"))
	}
	fmt.Printf("done after-ms=%d wall-says-held=%t err=%v\n",
		time.Since(start).Milliseconds(), wall().Before(lease.ExpiresAt()), lease.Err() != nil)

	// 4. Wait until the parent took the lock over and wrote, then act as a
	// client that trusts its wall clock: write and renew with the old token.
	sc := bufio.NewScanner(os.Stdin)
	if !sc.Scan() || sc.Text() != "taken" {
		return fail(errors.New("no takeover signal"))
	}
	write := "accepted"
	var fence int64
	if err := skewWrite(ctx, hc, table, pool, lease.Token(), "stale worker"); staleFence(err, &fence) {
		write = fmt.Sprintf("rejected fence=%d", fence)
	} else if err != nil {
		return fail(err)
	}
	renew := "accepted"
	if err := hc.RenewToken(ctx, locker, skewOwnLock, lease.Token(), skewOwnTTL); errors.Is(err, pgfence.ErrLost) {
		renew = "refused"
	} else if err != nil {
		return fail(err)
	}
	fmt.Printf("stale wall-says-held=%t write=%s renew=%s\n", wall().Before(lease.ExpiresAt()), write, renew)
	return 0
}

// skewWrite writes v to skew_rows row 1 under skewOwnLock's token, recorded
// by c.
func skewWrite(ctx context.Context, c *history.Client, table *fencedwrite.Table, db pgfence.DBTX, token int64, v string) error {
	return c.Fenced(skewOwnLock, token, fencedwrite.Strict, skewRowKey, v, func() error {
		_, err := table.Update(ctx, db, token, []any{1}, []any{v})
		return err
	})
}

// skewRowKey is the history key of skew_rows row 1.
const skewRowKey = "skew_rows/1"

// startSkewWorker starts this test binary as a skew worker under
// `faketime -f offset`, with a pipe to its stdin.
func startSkewWorker(t *testing.T, faketime, dsn, offset, journal string) (*proc, io.WriteCloser) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(faketime, "-f", offset, exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), envSkewWorker+"="+offset, envSkewDSN+"="+dsn, journal)
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
	p := &proc{cmd: cmd, lines: make(chan string, 16)}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
	}()
	t.Cleanup(func() {
		_ = stdin.Close()
		_ = cmd.Process.Signal(syscall.SIGKILL)
		_ = cmd.Wait()
	})
	return p, stdin
}

// fields parses "word k=v k=v ..." into a map.
func fields(line string) map[string]string {
	m := map[string]string{}
	for _, f := range strings.Fields(line)[1:] {
		if k, v, ok := strings.Cut(f, "="); ok {
			m[k] = v
		}
	}
	return m
}

// TestClockSkew runs a client process whose wall clock is an hour ahead and
// one whose wall clock is an hour behind the database's, next to a client
// with a correct clock (this test), and checks that grants, expiry and
// fencing are what they would be with a correct clock: the database clock
// decides.
//
// The clients run under Debian's faketime at ±1h. libfaketime cannot move Go's
// time.Now (the runtime reads the vDSO directly, not libc), so the worker
// measures its skew and, when it did not take, skews every wall-clock reading
// it makes itself; the printed line says which happened.
func TestClockSkew(t *testing.T) {
	t.Parallel()
	faketime, err := exec.LookPath("faketime")
	if err != nil {
		t.Fatal("faketime not found: the clock-skew test needs libfaketime's wrapper (Debian/Ubuntu: apt-get install faketime)")
	}
	// faketime itself must work: a libc program under it sees the offset.
	out, err := exec.Command(faketime, "-f", "+1h", "date", "+%s").Output()
	if err != nil {
		t.Fatalf("faketime -f +1h date: %v", err)
	}
	s, _ := strconv.ParseInt(strings.TrimSpace(string(out)), 10, 64)
	if d := s - time.Now().Unix(); math.Abs(float64(d-3600)) > 60 {
		t.Fatalf("faketime -f +1h date is off by %ds, want about 3600s: libfaketime does not work here", d)
	}
	for _, offset := range []string{"+1h", "-1h"} {
		t.Run(offset, func(t *testing.T) {
			t.Parallel()
			skewScenario(t, faketime, offset)
		})
	}
}

func skewScenario(t *testing.T, faketime, offset string) {
	ctx := context.Background()
	dsn := pgtest.DSN(t)
	pool := pgtest.PoolFor(t, dsn)
	if _, err := pool.Exec(ctx, `CREATE TABLE skew_rows (id int PRIMARY KEY, v text NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO skew_rows VALUES (1, 'start', 0)`); err != nil {
		t.Fatal(err)
	}
	locker, err := pglock.New(pool, &pglock.Config{Holder: "correct-clock", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()
	rec := history.New()
	rec.Seed(skewRowKey, "start")
	pc := rec.NewClient()
	held, err := pc.Acquire(ctx, locker, skewHeldLock, skewHeldTTL, true)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release(ctx)
	table, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "skew_rows", Key: []string{"id"}, Set: []string{"v"}})
	if err != nil {
		t.Fatal(err)
	}

	journal := filepath.Join(t.TempDir(), "journal")
	w, stdin := startSkewWorker(t, faketime, dsn, offset, rec.JournalEnv(journal, 1000))
	clock := w.next(t)
	c := fields(clock)
	eff, err := time.ParseDuration(c["effective"])
	if err != nil {
		t.Fatalf("clock line %q: %v", clock, err)
	}
	if want := map[string]time.Duration{"+1h": time.Hour, "-1h": -time.Hour}[offset]; (eff - want).Abs() > time.Minute {
		t.Fatalf("worker's effective clock is off by %s, want %s: %s", eff, offset, clock)
	}

	h := fields(w.next(t))
	if offset == "+1h" && h["looks-expired"] != "true" {
		t.Errorf("+1h client did not see the held lock as expired by its clock: the scenario tests nothing (%v)", h)
	}
	if h["tryacquire"] != "locked" {
		t.Errorf("%s client was granted a lock held by another client for %s: %v", offset, skewHeldTTL, h)
	}

	ownLine := w.next(t)
	sawGrant := time.Now()
	o := fields(ownLine)
	left, _ := strconv.Atoi(o["local-left-ms"])
	if left < int(skewOwnTTL.Milliseconds())-500 || left > int(skewOwnTTL.Milliseconds()) {
		t.Errorf("%s client's local deadline is %dms away right after the grant, want just under %s", offset, left, skewOwnTTL)
	}
	if o["write"] != "ok" {
		t.Errorf("%s client's fenced write with a live lease: %v", offset, o)
	}
	var dbTTL time.Duration
	if err := pool.QueryRow(ctx, "SELECT expires_at - acquired_at FROM pgfence.locks WHERE name = $1", skewOwnLock).Scan(&dbTTL); err != nil {
		t.Fatal(err)
	}
	if dbTTL != skewOwnTTL {
		t.Errorf("database lease length %s, want %s", dbTTL, skewOwnTTL)
	}

	d := fields(w.next(t))
	after, _ := strconv.Atoi(d["after-ms"])
	if after > int(skewOwnTTL.Milliseconds())+200 || d["err"] != "true" {
		t.Errorf("%s client's lease ended locally after %dms (want ≤ %s): %v", offset, after, skewOwnTTL, d)
	}
	if offset == "-1h" && d["wall-says-held"] != "true" {
		t.Errorf("-1h client's wall clock did not claim the lease was still held: the scenario tests nothing (%v)", d)
	}

	// Take the lock over as soon as the database allows, with a correct clock.
	var taken *pglock.Lease
	for taken == nil {
		l, err := pc.Acquire(ctx, locker, skewOwnLock, time.Minute, false)
		switch {
		case err == nil:
			taken = l
		case errors.Is(err, pgfence.ErrLocked):
			if time.Since(sawGrant) > skewOwnTTL+5*time.Second {
				t.Fatalf("lock still held %s after the %s client's grant", time.Since(sawGrant), offset)
			}
			time.Sleep(20 * time.Millisecond)
		default:
			t.Fatal(err)
		}
	}
	takeover := time.Since(sawGrant)
	defer taken.Release(ctx)
	if takeover < skewOwnTTL-500*time.Millisecond {
		t.Errorf("the %s client's lease was granted to another client %s after its grant, before its %s TTL", offset, takeover, skewOwnTTL)
	}
	if err := skewWrite(ctx, pc, table, pool, taken.Token(), "new holder"); err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(stdin, "taken\n"); err != nil {
		t.Fatal(err)
	}
	st := fields(w.next(t))
	if !strings.HasPrefix(st["write"], "rejected") || st["renew"] != "refused" {
		t.Errorf("%s client's stale write/renewal after the takeover: %v", offset, st)
	}
	w.rest(t)
	if err := rec.ReadJournal(journal); err != nil {
		t.Fatal(err)
	}
	rec.Verify(t)
	var v string
	var fence int64
	if err := pool.QueryRow(ctx, "SELECT v, fence FROM skew_rows WHERE id = 1").Scan(&v, &fence); err != nil {
		t.Fatal(err)
	}
	if v != "new holder" || fence != taken.Token() {
		t.Errorf("row after the stale write: v=%q fence=%d, want %q fence=%d", v, fence, "new holder", taken.Token())
	}
	t.Logf("clock skew %s: worker clock [%s]; held lock looks expired to it=%s, its TryAcquire=%s; own lease %s on the database, "+
		"ended locally after %dms (wall clock said held=%s), taken over %dms after its grant; stale write %s, stale renewal %s",
		offset, strings.TrimPrefix(clock, "clock "), h["looks-expired"], h["tryacquire"], dbTTL, after, d["wall-says-held"],
		takeover.Milliseconds(), st["write"], st["renew"])
}

// staleFence reports whether err is a stale fenced write
// (pgfence.ErrStaleToken) and reads the row's fence from its Reason, "row
// fence F > token T".
func staleFence(err error, fence *int64) bool {
	var pe *pgfence.Error
	if !errors.As(err, &pe) || pe.Kind != pgfence.ErrStaleToken {
		return false
	}
	var token int64
	n, _ := fmt.Sscanf(pe.Reason, "row fence %d > token %d", fence, &token)
	return n == 2 && token == pe.Token
}
