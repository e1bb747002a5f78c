package faultsuite

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/history"
	"github.com/pgfence/pgfence/internal/testing/pgserver"
	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pglock"
)

// standby is an asynchronous streaming replica of a local pgserver cluster.
type standby struct {
	dir, dataDir string
	port         int
	cmd          *exec.Cmd
	done         chan struct{}
}

func (s *standby) dsn() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
}

// startStandby copies the primary with pg_basebackup -R (which writes
// primary_conninfo and standby.signal) and starts it as a hot standby. When
// run as root, everything runs as the owner of the primary's data directory.
// The standby is stopped and removed when t ends.
func startStandby(t *testing.T, ctx context.Context, primary *pgserver.Server) *standby {
	t.Helper()
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		fi, err := os.Stat(primary.DataDir())
		if err != nil {
			t.Fatal(err)
		}
		st := fi.Sys().(*syscall.Stat_t)
		cred = &syscall.Credential{Uid: st.Uid, Gid: st.Gid, NoSetGroups: true}
	}
	dir, err := os.MkdirTemp("", "pgfence-standby-*")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			t.Fatal(err)
		}
	}
	u, err := pgx.ParseConfig(primary.DSN)
	if err != nil {
		t.Fatal(err)
	}
	binDir := primary.BinDir()
	s := &standby{dir: dir, dataDir: filepath.Join(dir, "data")}
	bctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	bb := exec.CommandContext(bctx, filepath.Join(binDir, "pg_basebackup"), "-D", s.dataDir, "-R", "-X", "stream",
		"-c", "fast", "-h", u.Host, "-p", strconv.Itoa(int(u.Port)), "-U", "postgres", "--no-sync")
	bb.Dir = dir
	bb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := bb.CombinedOutput(); err != nil {
		t.Fatalf("pg_basebackup: %v: %s", err, out)
	}
	l, err := netListenFreePort()
	if err != nil {
		t.Fatal(err)
	}
	s.port = l
	logf, err := os.Create(filepath.Join(dir, "standby.log"))
	if err != nil {
		t.Fatal(err)
	}
	// The primary's settings are command-line options, not in the copied
	// postgresql.conf, so give the standby what it needs here (a hot standby
	// needs max_connections ≥ the primary's).
	s.cmd = exec.Command(filepath.Join(binDir, "postgres"), "-D", s.dataDir, "-p", strconv.Itoa(s.port),
		"-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="+dir, "-c", "max_connections=400",
		"-c", "fsync=off", "-c", "wal_level=replica", "-c", "max_wal_senders=4", "-c", "hot_standby=on",
		"-c", "lc_messages=C", "-c", "log_min_messages=warning")
	s.cmd.Dir = dir
	s.cmd.Stdout, s.cmd.Stderr = logf, logf
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGQUIT, Setpgid: true}
	if err := s.cmd.Start(); err != nil {
		logf.Close()
		t.Fatal(err)
	}
	s.done = make(chan struct{})
	go func() { _ = s.cmd.Wait(); logf.Close(); close(s.done) }()
	t.Cleanup(func() {
		_ = s.cmd.Process.Signal(syscall.SIGINT) // fast shutdown
		select {
		case <-s.done:
		case <-time.After(30 * time.Second):
			_ = s.cmd.Process.Kill()
			<-s.done
		}
	})
	deadline := time.Now().Add(time.Minute)
	for {
		conn, err := pgx.Connect(ctx, s.dsn())
		if err == nil {
			var streaming bool
			err = conn.QueryRow(ctx, "SELECT pg_is_in_recovery() AND EXISTS (SELECT FROM pg_stat_wal_receiver WHERE status = 'streaming')").Scan(&streaming)
			conn.Close(ctx)
			if err == nil && streaming {
				return s
			}
		}
		select {
		case <-s.done:
			b, _ := os.ReadFile(filepath.Join(dir, "standby.log"))
			t.Fatalf("standby exited: %s", b)
		default:
		}
		if time.Now().After(deadline) {
			b, _ := os.ReadFile(filepath.Join(dir, "standby.log"))
			t.Fatalf("standby not streaming after a minute (last error %v): %s", err, b)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func netListenFreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// TestFailover runs grants and fenced writes against a primary with an
// asynchronous streaming standby, makes the standby lag (its WAL sender is
// frozen for the last part of the load, as a slow network or a busy standby
// would), crashes the primary and promotes the standby. On the new primary:
//
//   - every fenced row's fence is ≤ its lock's token (WAL is replayed in
//     order and a write's grant precedes it), so the first new grant fences
//     out every write the new primary has seen;
//   - grants acknowledged by the old primary but never replicated are lost:
//     the new primary issues those tokens again (the documented caveat of an
//     asynchronous failover), and the test counts them;
//   - raising every lock's token by a margin on promotion (an epoch bump)
//     makes the first new grant larger than every token ever acknowledged, so
//     fenced writes then refuse every old holder.
func TestFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary, err := pgserver.Start(ctx, pgserver.Options{NoContainers: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = primary.Stop() })
	setup, err := pgxpool.New(ctx, primary.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if err := migrations.UpPool(ctx, setup); err != nil {
		t.Fatal(err)
	}
	const keys = 4
	if _, err := setup.Exec(ctx, `CREATE TABLE fo_items (id int PRIMARY KEY, v bigint NOT NULL, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO fo_items SELECT g, 0, 0 FROM generate_series(0, `+strconv.Itoa(keys-1)+`) g`); err != nil {
		t.Fatal(err)
	}
	setup.Close()
	sb := startStandby(t, ctx, primary)

	// Load on the primary: grant, fenced write of the token, release.
	pool := bigPool(t, primary.DSN, 16)
	locker, err := pglock.New(pool, &pglock.Config{Holder: "old-primary-client", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	table, err := fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "fo_items", Key: []string{"id"}, Set: []string{"v"}})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	ackToken := make([]int64, keys) // highest grant acknowledged per key
	ackWrite := make([]int64, keys) // highest fenced write acknowledged per key
	grants := 0
	stop := make(chan struct{})
	rec := history.New()
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := w % keys
			lock := fmt.Sprintf("fo:%d", key)
			c := rec.NewClient()
			for {
				select {
				case <-stop:
					return
				default:
				}
				lease, err := c.Acquire(ctx, locker, lock, 2*time.Second, false)
				if errors.Is(err, pgfence.ErrLocked) {
					continue
				}
				if err != nil {
					return // the primary went away
				}
				mu.Lock()
				ackToken[key] = max(ackToken[key], lease.Token())
				grants++
				mu.Unlock()
				if err := c.Fenced(lock, lease.Token(), fencedwrite.Strict, fmt.Sprintf("fo_items/%d", key), fmt.Sprint(lease.Token()), func() error {
					_, err := table.Update(ctx, pool, lease.Token(), []any{key}, []any{lease.Token()})
					return err
				}); err != nil {
					return
				}
				mu.Lock()
				ackWrite[key] = max(ackWrite[key], lease.Token())
				mu.Unlock()
				if err := c.Release(ctx, lease); err != nil {
					return
				}
			}
		}()
	}
	time.Sleep(1500 * time.Millisecond)
	// Freeze the WAL sender: the standby stops receiving while the primary
	// keeps acknowledging grants and writes.
	var walsender int
	if err := pool.QueryRow(ctx, "SELECT pid FROM pg_stat_replication LIMIT 1").Scan(&walsender); err != nil {
		t.Fatalf("no WAL sender on the primary: %v", err)
	}
	if err := syscall.Kill(walsender, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	grantsBeforeLag := grants
	mu.Unlock()
	time.Sleep(700 * time.Millisecond)
	// Crash the primary: the WAL the sender never sent is gone with it.
	_ = syscall.Kill(walsender, syscall.SIGKILL)
	if err := primary.Kill(syscall.SIGQUIT); err != nil {
		t.Fatal(err)
	}
	close(stop)
	wg.Wait()
	_ = locker.Close()
	mu.Lock()
	lagGrants := grants - grantsBeforeLag
	mu.Unlock()

	// Promote the standby.
	np := bigPool(t, sb.dsn(), 8)
	var promoted bool
	if err := np.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&promoted); err != nil || !promoted {
		t.Fatalf("pg_promote: %v %v", promoted, err)
	}

	lostTokens, lostWrites, reissue := 0, 0, 0
	type row struct{ ID, Fence, Token int64 }
	r, err := np.Query(ctx, `SELECT i.id, i.fence, l.token FROM fo_items i JOIN pgfence.locks l ON l.name = 'fo:' || i.id ORDER BY i.id`)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := pgx.CollectRows(r, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != keys {
		t.Fatalf("new primary has %d of %d lock/row pairs", len(rows), keys)
	}
	for _, x := range rows {
		if x.Fence > x.Token {
			t.Errorf("new primary: row %d has fence %d above its lock's token %d: the first new grant would not fence it", x.ID, x.Fence, x.Token)
		}
		if d := ackToken[x.ID] - x.Token; d > 0 {
			lostTokens += int(d)
			reissue++ // the next grant of this lock reuses an acknowledged token
		}
		if ackWrite[x.ID] > x.Fence {
			lostWrites++
		}
	}
	if lostTokens == 0 {
		t.Errorf("no acknowledged grant was lost although the standby lagged for the last %d grants: the lag was not injected", lagGrants)
	}

	nl, err := pglock.New(np, &pglock.Config{Holder: "new-primary-client", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer nl.Close()
	ntable, err := fencedwrite.Prepare(ctx, np, fencedwrite.Spec{Table: "fo_items", Key: []string{"id"}, Set: []string{"v"}})
	if err != nil {
		t.Fatal(err)
	}

	// Without a bump, the next grant of key 0 re-issues a token the old
	// primary had acknowledged, and an old holder's fenced write with its
	// higher token still lands after the new holder wrote. The history
	// checker must say so.
	before := rec.Ops()
	nc := rec.NewClient()
	actx, cancel := context.WithTimeout(ctx, 30*time.Second)
	first, err := nc.Acquire(actx, nl, "fo:0", time.Minute, true) // waits out leases granted before the crash
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	if first.Token() > ackToken[0] {
		t.Errorf("key 0: first grant on the new primary %d is above the acknowledged %d, yet tokens were lost", first.Token(), ackToken[0])
	}
	fenced := func(c *history.Client, key int, token, v int64) error {
		return c.Fenced(fmt.Sprintf("fo:%d", key), token, fencedwrite.Strict, fmt.Sprintf("fo_items/%d", key), fmt.Sprint(v), func() error {
			_, err := ntable.Update(ctx, np, token, []any{key}, []any{v})
			return err
		})
	}
	if err := fenced(nc, 0, first.Token(), first.Token()); err != nil {
		t.Fatalf("first fenced write on the new primary: %v", err)
	}
	oldLanded := "refused"
	if first.Token() < ackToken[0] {
		if err := fenced(nc, 0, ackToken[0], -1); err == nil {
			oldLanded = "accepted"
		} else if !errors.Is(err, pgfence.ErrStaleToken) {
			t.Fatal(err)
		}
	}
	_ = nc.Release(ctx, first)
	noBump := rec.Ops()
	if vs, _ := history.Check(noBump); !reissued(vs, first.Token()) {
		t.Errorf("the history checker did not report token %d of fo:0 issued again after the failover without a bump: %v", first.Token(), vs)
	}

	// With an epoch bump on promotion, the next grant is above every token
	// ever acknowledged.
	const epoch = 1 << 32
	bumpAt := rec.Now()
	bumped, err := np.Query(ctx, "UPDATE pgfence.locks l SET token = l.token + $1 FROM pgfence.locks o WHERE o.name = l.name RETURNING l.name, o.token", int64(epoch))
	if err != nil {
		t.Fatal(err)
	}
	type bumpRow struct {
		Name   string
		Before int64
	}
	bumps, err := pgx.CollectRows(bumped, pgx.RowToStructByPos[bumpRow])
	if err != nil {
		t.Fatal(err)
	}
	bumpDone := rec.Now()
	// The history with the bump: the old primary's operations, the bump
	// (from what the new primary had), and what follows; without the
	// grant the new primary issued before the bump, it is legal.
	withBump := history.New()
	withBump.Add(before...)
	for _, b := range bumps {
		withBump.Add(history.Op{Client: withBump.Client() + 1000, Input: history.Input{Kind: history.Bump, Key: b.Name, Token: b.Before},
			Output: history.Output{Outcome: history.OK}, Call: bumpAt, Return: bumpDone})
	}
	after := len(rec.Ops())
	refused := 0
	for key := range keys {
		actx, cancel := context.WithTimeout(ctx, 30*time.Second)
		lease, err := nc.Acquire(actx, nl, fmt.Sprintf("fo:%d", key), time.Minute, true) // waits out leases granted before the crash
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if lease.Token() <= ackToken[key] {
			t.Errorf("key %d: first grant after the epoch bump is %d, not above the acknowledged %d", key, lease.Token(), ackToken[key])
		}
		if err := fenced(nc, key, lease.Token(), lease.Token()); err != nil {
			t.Fatalf("key %d: first fenced write on the new primary: %v", key, err)
		}
		// Every old holder, up to the highest token the old primary
		// acknowledged, is now refused.
		if err := fenced(nc, key, ackToken[key], -1); errors.Is(err, pgfence.ErrStaleToken) {
			refused++
		} else {
			t.Errorf("key %d: write with the old primary's last token %d on the new primary: %v", key, ackToken[key], err)
		}
		_ = nc.Release(ctx, lease)
	}
	withBump.Add(rec.Ops()[after:]...)
	withBump.Verify(t)
	t.Logf("failover: %d grants acknowledged by the old primary, the last %d while the standby lagged; after promotion: "+
		"fence ≤ token on all %d rows, %d acknowledged tokens lost (%d of %d locks would re-issue a token without a bump), "+
		"%d acknowledged fenced writes lost; without a bump the first new grant of lock 0 re-issued token %d (old primary acknowledged up to %d) "+
		"and a write with the old holder's token was then %s; after an epoch bump of 2^32 the first grants fenced out the old primary's highest token on %d of %d rows",
		grants, lagGrants, len(rows), lostTokens, reissue, keys, lostWrites, first.Token(), ackToken[0], oldLanded, refused, keys)
}

// reissued reports whether vs has a lease violation at a grant of token.
func reissued(vs []history.Violation, token int64) bool {
	for _, v := range vs {
		if v.Check == "lease" && v.Op.Input.Kind == history.Acquire && v.Op.Output.Token == token {
			return true
		}
	}
	return false
}
