//go:build unix

package localpg

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func show(t *testing.T, dsn, setting string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var v string
	if err := conn.QueryRow(ctx, "SHOW "+setting).Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestCluster runs a cluster through its life: start with extra settings,
// crash and restart with the data kept, stop, and nothing left behind.
func TestCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, err := Start(ctx, Options{Settings: map[string]string{"work_mem": "7MB"}})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { _ = c.Stop() })
	dir := filepath.Dir(c.DataDir())
	// BinDir is the real binaries directory, with the tools next to postgres.
	for _, tool := range []string{"initdb", "pg_ctl", "pg_basebackup"} {
		if _, err := os.Stat(filepath.Join(c.BinDir(), tool)); err != nil {
			t.Errorf("%s not in BinDir %s: %v", tool, c.BinDir(), err)
		}
	}
	if !strings.Contains(c.DSN(), ":"+strconv.Itoa(c.Port())+"/") {
		t.Errorf("DSN %s does not use port %d", c.DSN(), c.Port())
	}
	if v := show(t, c.DSN(), "server_version"); v == "" {
		t.Fatal("empty server_version")
	}
	if v := show(t, c.DSN(), "work_mem"); v != "7MB" {
		t.Errorf("work_mem = %s, want the 7MB of Options.Settings", v)
	}
	if v := show(t, c.DSN(), "fsync"); v != "off" {
		t.Errorf("fsync = %s, want off (not Durable)", v)
	}
	if v := show(t, c.DSN(), "listen_addresses"); v != "127.0.0.1" {
		t.Errorf("listen_addresses = %s, want loopback only", v)
	}
	if os.Geteuid() == 0 {
		// PostgreSQL refuses root: the cluster must belong to another user.
		st, err := os.Stat(c.DataDir())
		if err != nil {
			t.Fatal(err)
		}
		if st.Sys().(*syscall.Stat_t).Uid == 0 {
			t.Fatalf("data dir %s owned by root", c.DataDir())
		}
	}
	if err := c.Restart(ctx); !errors.Is(err, ErrRunning) {
		t.Fatalf("Restart while running: %v, want ErrRunning", err)
	}

	// An immediate shutdown and a restart keep the data.
	conn, err := pgx.Connect(ctx, c.DSN())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "CREATE TABLE survives (x int); INSERT INTO survives VALUES (7)"); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	if err := c.Kill(syscall.SIGQUIT); err != nil {
		t.Fatal(err)
	}
	if err := c.Kill(syscall.SIGQUIT); err != nil { // already stopped: nothing to do
		t.Fatal(err)
	}
	if err := c.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	conn, err = pgx.Connect(ctx, c.DSN())
	if err != nil {
		t.Fatal(err)
	}
	var x int
	if err := conn.QueryRow(ctx, "SELECT x FROM survives").Scan(&x); err != nil || x != 7 {
		t.Fatalf("after restart: x=%d err=%v", x, err)
	}
	conn.Close(ctx)

	if err := c.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("cluster directory %s still exists after Stop (err=%v)", dir, err)
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if conn, err := pgx.Connect(cctx, c.DSN()); err == nil {
		conn.Close(ctx)
		t.Fatal("server still answers after Stop")
	}
	if err := c.Stop(); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if err := c.Restart(ctx); !errors.Is(err, ErrStopped) {
		t.Fatalf("Restart after Stop: %v, want ErrStopped", err)
	}
}

// TestStartFailureLeavesNothing gives the server a setting it refuses: Start
// fails with the server's own message and removes its directory.
func TestStartFailureLeavesNothing(t *testing.T) {
	tmp := privateTempDir(t)
	t.Setenv("TMPDIR", tmp)
	_, err := Start(context.Background(), Options{Settings: map[string]string{"no_such_setting": "1"}})
	if err == nil {
		t.Fatal("Start succeeded with an unknown setting")
	}
	if !strings.Contains(err.Error(), "no_such_setting") {
		t.Errorf("error %q does not carry the server's complaint about no_such_setting", err)
	}
	entries, err := os.ReadDir(tmp)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		t.Errorf("failed Start left %s behind", e.Name())
	}
}

// TestNoBinaries: with no server binaries anywhere, Start says so with
// ErrNoBinaries and creates nothing.
func TestNoBinaries(t *testing.T) {
	empty := t.TempDir() // before TMPDIR changes
	tmp := privateTempDir(t)
	t.Setenv("TMPDIR", tmp)
	t.Setenv("PATH", empty)
	old := binGlob
	binGlob = filepath.Join(empty, "*", "bin")
	t.Cleanup(func() { binGlob = old })

	if _, err := FindBinDir(); !errors.Is(err, ErrNoBinaries) {
		t.Fatalf("FindBinDir: %v, want ErrNoBinaries", err)
	}
	if _, err := Start(context.Background(), Options{}); !errors.Is(err, ErrNoBinaries) {
		t.Fatalf("Start: %v, want ErrNoBinaries", err)
	}
	if entries, _ := os.ReadDir(tmp); len(entries) != 0 {
		t.Errorf("Start without binaries created %v", entries)
	}
}
