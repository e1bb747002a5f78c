package advisory_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
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
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock/advisory"
)

// bouncer is a PgBouncer started for one test. It serves two databases that
// both lead to the test's PostgreSQL database: "txn" in transaction pooling
// and "sess" in session pooling.
type bouncer struct {
	txnDSN, sessDSN string
}

// lockedBuffer collects PgBouncer's log for failure messages.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *lockedBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *lockedBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// startPgBouncer starts /usr/sbin/pgbouncer (or pgbouncer from PATH) in front
// of the database of dsn. It fails the test, never skips it, when PgBouncer
// is not installed. As root it runs PgBouncer as the postgres user, since
// PgBouncer refuses to run as root.
func startPgBouncer(t *testing.T, dsn string) bouncer {
	t.Helper()
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/pgbouncer"); serr == nil {
			bin = "/usr/sbin/pgbouncer"
		} else {
			t.Fatalf("pgbouncer is not installed (needed to test advisory locks through a transaction-mode pooler): " +
				"apt-get install pgbouncer (Debian/Ubuntu), or put a pgbouncer binary on PATH")
		}
	}
	cfg, err := pgconn.ParseConfig(dsn)
	if err != nil {
		t.Fatal(err)
	}

	dir, err := os.MkdirTemp("", "pgfence-pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("running as root and no postgres user to run pgbouncer as: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()

	quote := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
	server := fmt.Sprintf("host=%s port=%d dbname=%s user=%s", quote(cfg.Host), cfg.Port, quote(cfg.Database), quote(cfg.User))
	if cfg.Password != "" {
		server += " password=" + quote(cfg.Password)
	}
	ini := fmt.Sprintf(`[databases]
txn = %[1]s pool_mode=transaction pool_size=2
sess = %[1]s pool_mode=session pool_size=8

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %[2]d
unix_socket_dir =
auth_type = trust
auth_file = %[3]s
pool_mode = transaction
max_client_conn = 100
server_reset_query = DISCARD ALL
ignore_startup_parameters = extra_float_digits
`, server, port, filepath.Join(dir, "users.txt"))
	files := map[string]string{
		"pgbouncer.ini": ini,
		"users.txt":     fmt.Sprintf("%q \"\"\n", cfg.User),
	}
	for name, body := range files {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		if cred != nil {
			if err := os.Chown(p, int(cred.Uid), int(cred.Gid)); err != nil {
				t.Fatal(err)
			}
		}
	}

	var logBuf lockedBuffer
	cmd := exec.Command(bin, filepath.Join(dir, "pgbouncer.ini"))
	cmd.Dir = dir
	cmd.Stdout = &logBuf
	cmd.Stderr = &logBuf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Credential: cred}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start pgbouncer: %v", err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM) // immediate shutdown
		select {
		case <-exited:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("pgbouncer log:\n%s", logBuf.String())
		}
	})

	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	deadline := time.Now().Add(15 * time.Second)
	for {
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("pgbouncer exited at start-up (%v):\n%s", err, logBuf.String())
		default:
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgbouncer did not listen on %s within 15s:\n%s", addr, logBuf.String())
		}
		time.Sleep(20 * time.Millisecond) // no readiness signal other than the port
	}
	mk := func(db string) string {
		u := url.URL{Scheme: "postgres", User: url.User(cfg.User), Host: addr, Path: "/" + db,
			// PgBouncer before 1.21 cannot keep named prepared statements
			// across transactions; exec mode uses unnamed ones.
			RawQuery: "sslmode=disable&default_query_exec_mode=exec"}
		return u.String()
	}
	return bouncer{txnDSN: mk("txn"), sessDSN: mk("sess")}
}

// TestPgBouncerTransactionMode: through a real PgBouncer in transaction
// pooling, Xact still gives mutual exclusion, and the session API refuses
// with ErrPooler instead of taking a lock on a server connection it cannot
// keep.
func TestPgBouncerTransactionMode(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	direct := pgtest.PoolFor(t, dsn)
	b := startPgBouncer(t, dsn)
	viaBouncer := pgtest.PoolFor(t, b.txnDSN)
	ctx := testCtx(t)
	newCounter(t, direct)

	// Transactions through the bouncer do run on shared server connections:
	// two client connections reach the same backend.
	c1, err := viaBouncer.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var p1, p2 uint32
	if err := c1.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&p1); err != nil {
		t.Fatal(err)
	}
	if err := viaBouncer.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&p2); err != nil {
		t.Fatal(err)
	}
	c1.Release()
	if p1 != p2 {
		t.Fatalf("two client connections reached backends %d and %d: PgBouncer is not sharing server connections", p1, p2)
	}

	// Why session locks must be refused here: a raw pg_try_advisory_lock from
	// one client connection lands on a shared server connection, and a second
	// client connection "gets" the same lock too (re-entrantly, on the same
	// backend). Nothing is mutually exclusive any more.
	raw := fmt.Sprintf("SELECT pg_try_advisory_lock(%d)", int64(77))
	c1, err = viaBouncer.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var got1, got2 bool
	if err := c1.QueryRow(ctx, raw).Scan(&got1); err != nil {
		t.Fatal(err)
	}
	if err := viaBouncer.QueryRow(ctx, raw).Scan(&got2); err != nil {
		t.Fatal(err)
	}
	c1.Release()
	if !got1 || !got2 {
		t.Fatalf("raw session locks through PgBouncer: first %v second %v; expected both clients to 'hold' it", got1, got2)
	}
	// The lock now sits on a server connection no client owns; only ending
	// that backend frees it.
	locks := advisoryLocks(t, direct)
	if len(locks) != 1 {
		t.Fatalf("List = %+v, want the stray lock", locks)
	}
	if _, err := direct.Exec(ctx, "SELECT pg_terminate_backend($1)", locks[0].PID); err != nil {
		t.Fatal(err)
	}
	waitLocks(t, direct, "want the stray lock gone", func(l []advisory.LockInfo) bool { return len(l) == 0 })

	key := advisory.MustName("bouncer-counter")
	const workers, rounds = 2, 150
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range rounds {
				if err := advisory.Xact(ctx, viaBouncer, key, advisory.Exclusive, func(tx pgx.Tx) error {
					return incrementInTx(ctx, tx)
				}); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if got := counterValue(t, direct); got != workers*rounds {
		t.Fatalf("counter = %d through PgBouncer, want %d", got, workers*rounds)
	}
	// TryXact through the bouncer sees a lock held by a direct session.
	err = advisory.Xact(ctx, direct, key, advisory.Exclusive, func(pgx.Tx) error {
		err := advisory.TryXact(ctx, viaBouncer, key, advisory.Exclusive, func(pgx.Tx) error { return nil })
		if !errors.Is(err, pgfence.ErrLocked) {
			t.Errorf("TryXact through PgBouncer while held directly: %v, want ErrLocked", err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	// The session API is refused, with or without AllowPooler, and leaves
	// nothing locked on any backend.
	for _, cfg := range []*advisory.SessionConfig{nil, {AllowPooler: true}} {
		for name, acquire := range map[string]func(context.Context, *pgxpool.Pool, advisory.Key, advisory.Mode, *advisory.SessionConfig) (*advisory.SessionLock, error){
			"Acquire": advisory.Acquire, "TryAcquire": advisory.TryAcquire,
		} {
			l, err := acquire(ctx, viaBouncer, key, advisory.Exclusive, cfg)
			if l != nil || !isPooler(err) {
				if l != nil {
					_ = l.Release(ctx)
				}
				t.Fatalf("%s through PgBouncer (transaction mode, %+v): %v, %v; want ErrInvalid for a pooler", name, cfg, l, err)
			}
			if !strings.Contains(err.Error(), "advisory.Xact") {
				t.Errorf("error does not tell what to do instead: %v", err)
			}
			t.Logf("%s, AllowPooler=%v: %v", name, cfg != nil, err)
		}
	}
	requireNoLocks(t, direct)
	if got := viaBouncer.Stat().AcquiredConns(); got != 0 {
		t.Fatalf("AcquiredConns = %d through PgBouncer after refusals", got)
	}
}

// TestPgBouncerSessionMode: a pooler in session mode is refused by default
// (it cannot be told from transaction mode by the startup check) and works
// with AllowPooler, which checks that backends are not shared.
func TestPgBouncerSessionMode(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	direct := pgtest.PoolFor(t, dsn)
	b := startPgBouncer(t, dsn)
	viaBouncer := pgtest.PoolFor(t, b.sessDSN)
	ctx := testCtx(t)
	key := advisory.MustName("bouncer-session")

	if l, err := advisory.Acquire(ctx, viaBouncer, key, advisory.Exclusive, nil); !isPooler(err) {
		if l != nil {
			_ = l.Release(ctx)
		}
		t.Fatalf("Acquire through a session-mode PgBouncer without AllowPooler: %v, want ErrPooler", err)
	}
	requireNoLocks(t, direct)

	l, err := advisory.Acquire(ctx, viaBouncer, key, advisory.Exclusive,
		&advisory.SessionConfig{AllowPooler: true, PingInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatalf("Acquire through a session-mode PgBouncer with AllowPooler: %v", err)
	}
	locks := advisoryLocks(t, direct)
	if len(locks) != 1 || locks[0].PID != int32(l.PID()) || locks[0].Key != key {
		t.Fatalf("List = %+v, want the lock held by backend %d", locks, l.PID())
	}
	requireLocked(t, direct, key)
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	requireNoLocks(t, direct)
	requireFree(t, direct, key)

	// A terminated server connection ends the client's session: Done fires.
	l, err = advisory.Acquire(ctx, viaBouncer, key, advisory.Exclusive,
		&advisory.SessionConfig{AllowPooler: true, PingInterval: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := direct.Exec(ctx, "SELECT pg_terminate_backend($1)", int32(l.PID())); err != nil {
		t.Fatal(err)
	}
	select {
	case <-l.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("Done not closed after the server connection behind PgBouncer was terminated")
	}
	if err := l.Release(ctx); !errors.Is(err, pgfence.ErrLost) {
		t.Fatalf("Unlock after loss = %v, want ErrLost", err)
	}
	waitLocks(t, direct, "want no locks", func(l []advisory.LockInfo) bool { return len(l) == 0 })
}

// isPooler reports whether err refuses the pool because a pooler in
// transaction mode was detected.
func isPooler(err error) bool {
	return isInvalid(err, "pool") && strings.Contains(pfError(err).Reason, "a pooler in transaction or statement mode was detected") &&
		strings.Contains(pfError(err).Reason, "SessionConfig.AllowPooler")
}
