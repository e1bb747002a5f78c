// Package localpg starts a throwaway PostgreSQL cluster from the server
// binaries installed on this machine, for pgfence's demo, tests and
// benchmarks.
//
// [Start] runs initdb in a new temporary directory and then the postmaster as a
// child process listening on 127.0.0.1 (a free port) and on a unix socket
// inside that directory; it returns once the server accepts connections. The
// binaries are looked up by [FindBinDir]. When the current process is root, the
// cluster runs as the "postgres" user (or "nobody"), since PostgreSQL refuses
// to run as root.
//
// [Cluster.Stop] shuts the server down and removes the directory. On Linux the
// postmaster is also started with a parent-death signal, so it dies with the
// process that started it even when that process is killed; on other Unix
// systems a killed parent leaves it running. Directories left behind by a
// process that died are removed by the next Start.
//
// The package imports only the standard library and pgx, so a binary that uses
// it stays small.
package localpg

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// dirPrefix starts the name of every cluster directory, so that stale ones
// can be found and swept.
const dirPrefix = "pgfence-pg-"

// Options configure [Start]. The zero value is usable.
type Options struct {
	// Durable keeps PostgreSQL's default durability (fsync on). By default the
	// cluster runs with fsync and full_page_writes off, which is safe for
	// throwaway data only.
	Durable bool
	// Settings are extra server settings (name → value), passed to the
	// postmaster as -c name=value; they override pgfence's defaults.
	Settings map[string]string
	// Log receives progress lines. Defaults to io.Discard.
	Log io.Writer
}

// Cluster is a running throwaway PostgreSQL cluster started by [Start]. Its
// methods are safe for concurrent use.
type Cluster struct {
	binDir  string
	dir     string
	dataDir string
	sockDir string
	logPath string
	port    int
	owner   *owner
	args    []string

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	removed bool
}

// DSN connects as the superuser "postgres" (trust authentication, no
// password) to the database "postgres" over TCP on 127.0.0.1.
func (c *Cluster) DSN() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.port)
}

// Port returns the TCP port the server listens on (127.0.0.1 only).
func (c *Cluster) Port() int { return c.port }

// DataDir returns the cluster's data directory.
func (c *Cluster) DataDir() string { return c.dataDir }

// BinDir returns the directory of the PostgreSQL binaries the cluster runs
// (the other server tools, such as pg_basebackup, are there too).
func (c *Cluster) BinDir() string { return c.binDir }

// Start creates and starts a cluster. It fails with [ErrNoBinaries] when no
// server binaries are installed, [ErrNoUnprivilegedUser] when run as root
// without a user to run PostgreSQL as, [ErrUnsupported] on non-Unix systems,
// and otherwise with initdb's or the server's last log lines. Nothing is left
// behind when it fails. ctx bounds initdb and the wait for the server.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	if !supported {
		return nil, ErrUnsupported
	}
	logw := opts.Log
	if logw == nil {
		logw = io.Discard
	}
	binDir, err := FindBinDir()
	if err != nil {
		return nil, err
	}
	sweepStale(os.TempDir())

	dir, err := os.MkdirTemp("", dirPrefix+"*")
	if err != nil {
		return nil, fmt.Errorf("localpg: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(dir)
		}
	}()
	if err := os.WriteFile(filepath.Join(dir, "owner.pid"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return nil, fmt.Errorf("localpg: %w", err)
	}
	c := &Cluster{
		binDir:  binDir,
		dir:     dir,
		dataDir: filepath.Join(dir, "data"),
		sockDir: filepath.Join(dir, "sock"),
		logPath: filepath.Join(dir, "postgres.log"),
	}
	if err := os.Mkdir(c.sockDir, 0o700); err != nil {
		return nil, fmt.Errorf("localpg: %w", err)
	}
	if c.owner, err = unprivilegedOwner(dir, c.sockDir); err != nil {
		return nil, err
	}

	fmt.Fprintf(logw, "running initdb in %s\n", dir)
	initdb := exec.CommandContext(ctx, filepath.Join(binDir, "initdb"),
		"-D", c.dataDir, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
	initdb.SysProcAttr = procAttr(c.owner, false)
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("localpg: initdb: %v: %s", err, lastLines(out, 10))
	}
	c.args = serverArgs(c.sockDir, opts)

	var lastErr error
	for range 5 { // a free port can be taken between FreePort and the bind
		if c.port, err = FreePort(); err != nil {
			return nil, fmt.Errorf("localpg: %w", err)
		}
		if lastErr = c.start(ctx); lastErr == nil || ctx.Err() != nil {
			break
		}
	}
	if lastErr != nil {
		return nil, lastErr
	}
	fmt.Fprintf(logw, "PostgreSQL from %s listening on 127.0.0.1:%d\n", binDir, c.port)
	ok = true
	return c, nil
}

// serverArgs returns the postmaster's -c options in a stable order.
func serverArgs(sockDir string, opts Options) []string {
	settings := map[string]string{
		"listen_addresses":           "127.0.0.1",
		"unix_socket_directories":    sockDir,
		"max_connections":            "400",
		"shared_buffers":             "128MB",
		"log_min_messages":           "warning",
		"max_wal_senders":            "4",
		"wal_level":                  "replica",
		"max_replication_slots":      "4",
		"lc_messages":                "C",
		"dynamic_shared_memory_type": "posix",
	}
	if !opts.Durable {
		settings["fsync"] = "off"
		settings["full_page_writes"] = "off"
	}
	for k, v := range opts.Settings {
		settings[k] = v
	}
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	args := make([]string, 0, 2*len(keys))
	for _, k := range keys {
		args = append(args, "-c", k+"="+settings[k])
	}
	return args
}

// Restart starts a cluster stopped by [Cluster.Kill] again, on the same port
// and data directory, and waits until it accepts connections. It returns
// [ErrRunning] while the server runs and [ErrStopped] after [Cluster.Stop].
func (c *Cluster) Restart(ctx context.Context) error {
	return c.start(ctx)
}

func (c *Cluster) start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.removed {
		return ErrStopped
	}
	if c.cmd != nil {
		return ErrRunning
	}
	logf, err := os.OpenFile(c.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("localpg: %w", err)
	}
	args := append([]string{"-D", c.dataDir, "-p", strconv.Itoa(c.port)}, c.args...)
	cmd := exec.Command(filepath.Join(c.binDir, "postgres"), args...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.Dir = c.dir
	cmd.SysProcAttr = procAttr(c.owner, true)
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("localpg: start postgres: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(done)
	}()
	c.cmd, c.done = cmd, done

	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case <-done:
			c.cmd, c.done = nil, nil
			out, _ := os.ReadFile(c.logPath)
			return fmt.Errorf("localpg: postgres exited during startup: %s", lastLines(out, 15))
		default:
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := ping(pctx, c.DSN())
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			_ = cmd.Process.Signal(syscall.SIGQUIT)
			<-done
			c.cmd, c.done = nil, nil
			out, _ := os.ReadFile(c.logPath)
			return fmt.Errorf("localpg: postgres did not accept connections: %v: %s", err, lastLines(out, 15))
		}
		time.Sleep(25 * time.Millisecond)
	}
}

// Kill stops the server without removing its data: SIGQUIT is an immediate
// shutdown (crash recovery at the next start), SIGINT a fast one. It waits
// until the postmaster has exited (at most 30s, then SIGKILL). Killing a
// stopped cluster does nothing.
func (c *Cluster) Kill(sig syscall.Signal) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.killLocked(sig)
}

func (c *Cluster) killLocked(sig syscall.Signal) error {
	if c.cmd == nil {
		return nil
	}
	if err := c.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("localpg: signal postgres: %w", err)
	}
	select {
	case <-c.done:
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
	c.cmd, c.done = nil, nil
	return nil
}

// Stop shuts the server down (fast shutdown) and removes its directory. It is
// safe to call more than once.
func (c *Cluster) Stop() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.killLocked(syscall.SIGINT); err != nil {
		return err
	}
	c.removed = true
	if err := os.RemoveAll(c.dir); err != nil {
		return fmt.Errorf("localpg: %w", err)
	}
	return nil
}

func ping(ctx context.Context, dsn string) error {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx)
}

// sweepStale removes the cluster directories in root whose owning process no
// longer exists (a process killed before it could clean up).
func sweepStale(root string) {
	dirs, _ := filepath.Glob(filepath.Join(root, dirPrefix+"*"))
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "owner.pid"))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 {
			continue
		}
		if processGone(pid) {
			_ = os.RemoveAll(d)
		}
	}
}

func lastLines(b []byte, n int) string {
	lines := bytes.Split(bytes.TrimSpace(b), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte(" | ")))
}
