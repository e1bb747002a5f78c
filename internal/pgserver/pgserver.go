// Package pgserver finds or starts a PostgreSQL server for pgfence's tests, its
// demo and its benchmarks.
//
// [Start] tries, in order:
//
//  1. a DSN given in [Options.DSN] or in the environment variable named by
//     [Options.EnvVar] (for tests: PGFENCE_TEST_DATABASE_URL);
//  2. testcontainers-go's postgres module, when a Docker engine answers;
//  3. a throwaway cluster made from the PostgreSQL server binaries found on PATH or
//     under /usr/lib/postgresql/*/bin: initdb in a temporary directory, then the
//     postmaster started as a child process listening on 127.0.0.1 and a unix
//     socket inside that directory. When the current process is root, the cluster
//     runs as the "postgres" user (or "nobody"), since PostgreSQL refuses to run
//     as root.
//
// If none of these works, Start returns an [*UnavailableError] that names what to
// install. A local cluster is started with the parent-death signal set, so it dies
// with the process that started it even when that process is killed; its
// directory is removed by [Server.Stop], and directories left behind by a process
// that died are swept by the next Start.
package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Kind names the way a server was obtained.
type Kind string

// The kinds of server, in the order Start tries them.
const (
	KindDSN            Kind = "dsn"
	KindTestcontainers Kind = "testcontainers"
	KindLocal          Kind = "local-binaries"
)

// Options configure [Start]. The zero value is usable.
type Options struct {
	// DSN, when set, is used as is and nothing is started.
	DSN string
	// EnvVar names an environment variable that may hold a DSN. Ignored when DSN
	// is set. Defaults to no variable.
	EnvVar string
	// Durable keeps PostgreSQL's default durability (fsync on). By default a
	// local cluster runs with fsync and full_page_writes off, which is safe for
	// throwaway test data only.
	Durable bool
	// Settings are extra server settings (name → value) for a local cluster,
	// passed as -c name=value.
	Settings map[string]string
	// NoContainers skips the testcontainers attempt.
	NoContainers bool
	// NoLocal skips the local-binaries attempt.
	NoLocal bool
	// Log receives progress lines. Defaults to io.Discard.
	Log io.Writer
}

// Attempt records one way of getting a server that Start tried.
type Attempt struct {
	Kind Kind
	Err  error // nil when this attempt produced the server
}

// UnavailableError is returned by [Start] when no server could be had.
type UnavailableError struct {
	Attempts []Attempt
}

func (e *UnavailableError) Error() string {
	var b strings.Builder
	b.WriteString("pgserver: no PostgreSQL server available: ")
	for i, a := range e.Attempts {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s: %v", a.Kind, a.Err)
	}
	b.WriteString(". To fix: set PGFENCE_TEST_DATABASE_URL to a server where the user may CREATE DATABASE, " +
		"or start a Docker engine, or install the PostgreSQL server binaries " +
		"(Debian/Ubuntu: apt-get install postgresql; initdb, pg_ctl and postgres are looked up on PATH " +
		"and under /usr/lib/postgresql/*/bin)")
	return b.String()
}

// Server is a PostgreSQL server ready for connections.
type Server struct {
	// Kind says how the server was obtained.
	Kind Kind
	// DSN connects as a superuser (or the DSN's user) to an existing database.
	DSN string
	// Attempts lists every way Start tried, including those that failed.
	Attempts []Attempt

	local     *localCluster
	terminate func(context.Context) error
	stopOnce  sync.Once
	stopErr   error
}

// Start finds or starts a server in the order described in the package doc.
func Start(ctx context.Context, opts Options) (*Server, error) {
	logw := opts.Log
	if logw == nil {
		logw = io.Discard
	}
	var attempts []Attempt

	dsn := opts.DSN
	if dsn == "" && opts.EnvVar != "" {
		dsn = os.Getenv(opts.EnvVar)
	}
	if dsn != "" {
		if err := ping(ctx, dsn); err != nil {
			attempts = append(attempts, Attempt{KindDSN, err})
			return nil, &UnavailableError{Attempts: attempts}
		}
		attempts = append(attempts, Attempt{Kind: KindDSN})
		return &Server{Kind: KindDSN, DSN: dsn, Attempts: attempts}, nil
	}
	if opts.EnvVar != "" {
		attempts = append(attempts, Attempt{KindDSN, fmt.Errorf("%s is not set", opts.EnvVar)})
	}

	if opts.NoContainers {
		attempts = append(attempts, Attempt{KindTestcontainers, errors.New("disabled")})
	} else {
		s, err := startContainer(ctx, logw)
		if err == nil {
			s.Attempts = append(attempts, Attempt{Kind: KindTestcontainers})
			return s, nil
		}
		attempts = append(attempts, Attempt{KindTestcontainers, err})
	}

	if opts.NoLocal {
		attempts = append(attempts, Attempt{KindLocal, errors.New("disabled")})
		return nil, &UnavailableError{Attempts: attempts}
	}
	lc, err := startLocal(ctx, opts, logw)
	if err != nil {
		attempts = append(attempts, Attempt{KindLocal, err})
		return nil, &UnavailableError{Attempts: attempts}
	}
	attempts = append(attempts, Attempt{Kind: KindLocal})
	return &Server{Kind: KindLocal, DSN: lc.dsn(), Attempts: attempts, local: lc}, nil
}

// Stop shuts the server down and removes what Start created. A DSN server is
// left alone. Stop is safe to call more than once.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		switch {
		case s.local != nil:
			s.stopErr = s.local.stop()
		case s.terminate != nil:
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			s.stopErr = s.terminate(ctx)
		}
	})
	return s.stopErr
}

// Local reports whether the server is a local cluster this process controls, so
// that [Server.Kill] and [Server.Restart] can be used (fault tests).
func (s *Server) Local() bool { return s.local != nil }

// DataDir returns the data directory of a local cluster, or "".
func (s *Server) DataDir() string {
	if s.local == nil {
		return ""
	}
	return s.local.dataDir
}

// BinDir returns the directory of the PostgreSQL binaries of a local cluster, or "".
func (s *Server) BinDir() string {
	if s.local == nil {
		return ""
	}
	return s.local.binDir
}

// Kill stops a local cluster without removing its data: sig SIGQUIT is an
// immediate shutdown (crash recovery at the next start), SIGINT a fast one.
func (s *Server) Kill(sig syscall.Signal) error {
	if s.local == nil {
		return errors.New("pgserver: Kill needs a local cluster")
	}
	return s.local.kill(sig)
}

// Restart starts a local cluster stopped by [Server.Kill] again, on the same
// port and data directory, and waits until it accepts connections.
func (s *Server) Restart(ctx context.Context) error {
	if s.local == nil {
		return errors.New("pgserver: Restart needs a local cluster")
	}
	return s.local.start(ctx)
}

func ping(ctx context.Context, dsn string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx)
}

// ---- local binaries ----

const dirPrefix = "pgfence-pg-"

type localCluster struct {
	binDir  string
	dir     string
	dataDir string
	sockDir string
	port    int
	cred    *syscall.Credential
	args    []string
	logPath string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

func (c *localCluster) dsn() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", c.port)
}

// FindBinDir returns the directory holding initdb, pg_ctl, postgres and the
// other server binaries (pg_basebackup, ...): the one of postgres on PATH
// (links followed) first, else the highest version under
// /usr/lib/postgresql/*/bin.
func FindBinDir() (string, error) {
	if p, err := exec.LookPath("postgres"); err == nil {
		// PATH often holds links (Debian's /usr/local/bin or pg_wrapper):
		// follow them to the directory that also has pg_basebackup & co.
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		dir := filepath.Dir(p)
		if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, "initdb")); err == nil {
			return d, nil
		}
	}
	return "", errors.New("initdb not found on PATH or under /usr/lib/postgresql/*/bin")
}

func versionOf(binDir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	return v
}

func startLocal(ctx context.Context, opts Options, logw io.Writer) (*localCluster, error) {
	binDir, err := FindBinDir()
	if err != nil {
		return nil, err
	}
	sweepStale()

	dir, err := os.MkdirTemp("", dirPrefix+"*")
	if err != nil {
		return nil, err
	}
	ok := false
	defer func() {
		if !ok {
			_ = os.RemoveAll(dir)
		}
	}()
	if err := os.WriteFile(filepath.Join(dir, "owner.pid"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return nil, err
	}
	c := &localCluster{
		binDir:  binDir,
		dir:     dir,
		dataDir: filepath.Join(dir, "data"),
		sockDir: filepath.Join(dir, "sock"),
		logPath: filepath.Join(dir, "postgres.log"),
	}
	if err := os.Mkdir(c.sockDir, 0o700); err != nil {
		return nil, err
	}
	if os.Geteuid() == 0 {
		cred, err := unprivilegedUser()
		if err != nil {
			return nil, err
		}
		c.cred = cred
		for _, p := range []string{dir, c.sockDir} {
			if err := os.Chown(p, int(cred.Uid), int(cred.Gid)); err != nil {
				return nil, err
			}
		}
		if err := os.Chmod(dir, 0o755); err != nil {
			return nil, err
		}
	}

	fmt.Fprintf(logw, "pgserver: initdb in %s\n", dir)
	initdb := exec.CommandContext(ctx, filepath.Join(binDir, "initdb"),
		"-D", c.dataDir, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("initdb: %v: %s", err, lastLines(out, 10))
	}

	settings := map[string]string{
		"listen_addresses":           "127.0.0.1",
		"unix_socket_directories":    c.sockDir,
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
	for _, k := range keys {
		c.args = append(c.args, "-c", k+"="+settings[k])
	}

	var lastErr error
	for range 5 {
		c.port, err = FreePort()
		if err != nil {
			return nil, err
		}
		if lastErr = c.start(ctx); lastErr == nil {
			break
		}
		if ctx.Err() != nil {
			break
		}
	}
	if lastErr != nil {
		return nil, lastErr
	}
	fmt.Fprintf(logw, "pgserver: PostgreSQL from %s listening on 127.0.0.1:%d\n", binDir, c.port)
	ok = true
	return c, nil
}

func (c *localCluster) start(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd != nil {
		return errors.New("pgserver: cluster already running")
	}
	logf, err := os.OpenFile(c.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	args := append([]string{"-D", c.dataDir, "-p", strconv.Itoa(c.port)}, c.args...)
	cmd := exec.Command(filepath.Join(c.binDir, "postgres"), args...)
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.Dir = c.dir
	// Pdeathsig: the postmaster gets SIGQUIT (immediate shutdown) if this
	// process dies first, so no server outlives a crashed test binary.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Pdeathsig: syscall.SIGQUIT, Setpgid: true}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("start postgres: %w", err)
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
			return fmt.Errorf("postgres exited during startup: %s", lastLines(out, 15))
		default:
		}
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := ping(pctx, c.dsn())
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			_ = cmd.Process.Signal(syscall.SIGQUIT)
			<-done
			c.cmd, c.done = nil, nil
			out, _ := os.ReadFile(c.logPath)
			return fmt.Errorf("postgres did not accept connections: %v: %s", err, lastLines(out, 15))
		}
		time.Sleep(25 * time.Millisecond)
	}
}

func (c *localCluster) kill(sig syscall.Signal) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cmd == nil {
		return nil
	}
	_ = c.cmd.Process.Signal(sig)
	select {
	case <-c.done:
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
	c.cmd, c.done = nil, nil
	return nil
}

func (c *localCluster) stop() error {
	_ = c.kill(syscall.SIGINT)
	return os.RemoveAll(c.dir)
}

func unprivilegedUser() (*syscall.Credential, error) {
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, nil
	}
	return nil, errors.New("running as root and no unprivileged user (postgres or nobody) exists to run PostgreSQL")
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// sweepStale removes cluster directories whose owning process no longer exists
// (a test binary killed before it could clean up).
func sweepStale() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "owner.pid"))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 {
			continue
		}
		if err := syscall.Kill(pid, 0); errors.Is(err, syscall.ESRCH) {
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
