// Package hacluster starts a throwaway high-availability PostgreSQL cluster for
// pgfence's tests: one etcd member (with the v2 API enabled) and three
// PostgreSQL nodes managed by Patroni, all listening on 127.0.0.1 ports picked
// by the kernel, in a temporary directory with a short path (unix socket paths
// are limited to 107 bytes). It is a test helper: no library or command
// package imports it.
//
// It installs nothing. Patroni (Debian: patroni, with python3-etcd), etcd
// (Debian: etcd-server) and the PostgreSQL server binaries must be present;
// [Available] says what is missing and [Start] fails the test with that
// message (`apt-get install patroni etcd-server`, or `make test-deps`). Tests
// never skip because of it.
//
// When the test runs as root, Patroni and PostgreSQL run as the postgres
// user: the directories are chowned to it and its parents must be
// traversable. Patroni uses the etcd v2 DCS (the `etcd:` section): with
// Debian's Patroni 3.0.2 the `etcd3:` DCS can let a paused-then-resumed
// primary overwrite the leader key (fixed upstream in 3.0.3), the v2 DCS
// demotes it cleanly. Each node has its own pgpass file and socket directory.
// Readiness comes from Patroni's REST API (a leader, every other node
// streaming from it, a synchronous standby in synchronous modes) and from a
// write-capable connection to the leader.
//
// Everything started is stopped by [Cluster.Stop], which Start registers with
// t.Cleanup (it also runs when the test panics). Patroni daemonizes the
// postmaster, so Stop also reads each node's postmaster.pid, checks in
// /proc/<pid>/cmdline that the process is that node's postmaster, and shuts
// it down; then it verifies that no process whose command line carries the
// cluster's unique token (its directory name, also PostgreSQL's cluster_name,
// so every backend's title has it) is left, treating zombies as dead. A test
// timeout or a killed test binary skips t.Cleanup: for that case a watchdog
// shell process in its own session holds a pipe from the test process and,
// when the pipe closes without a "done", kills everything carrying the token
// and removes the directory.
package hacluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// Mode is the replication mode Patroni enforces.
type Mode int

// The replication modes.
const (
	// Async is asynchronous streaming replication: a failover may lose
	// commits the old primary acknowledged.
	Async Mode = iota
	// Sync is Patroni's synchronous_mode: true. One standby is synchronous
	// and only it may be promoted; when no standby is available the primary
	// keeps accepting commits on its own.
	Sync
	// SyncStrict adds synchronous_mode_strict: true: with no synchronous
	// standby, commits wait.
	SyncStrict
)

func (m Mode) String() string {
	switch m {
	case Async:
		return "async"
	case Sync:
		return "sync"
	case SyncStrict:
		return "sync-strict"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// InstallHint is what to run when Patroni or etcd is missing.
const InstallHint = "apt-get install patroni etcd-server (or, as root on Debian/Ubuntu, make test-deps)"

// Options configure [Start]. The zero value gives three nodes in
// asynchronous mode with the timings below.
type Options struct {
	// Nodes is the number of PostgreSQL nodes. Defaults to 3.
	Nodes int
	// Mode is the replication mode. Defaults to Async.
	Mode Mode
	// TTL, LoopWait and RetryTimeout are Patroni's, in seconds. Default 10,
	// 2 and 4 (loop_wait + 2 × retry_timeout ≤ ttl).
	TTL, LoopWait, RetryTimeout int
	// PrimaryStartTimeout is Patroni's primary_start_timeout in seconds. The
	// default 0 makes a crashed primary fail over at once instead of being
	// restarted in place.
	PrimaryStartTimeout int
	// MaximumLagOnFailover is Patroni's maximum_lag_on_failover in bytes.
	// Defaults to 64 MiB, so a lagging asynchronous replica may still be
	// promoted (the case the tests measure).
	MaximumLagOnFailover int64
	// Parameters are PostgreSQL settings for every node, added to (and
	// overriding) the defaults.
	Parameters map[string]string
	// OnRoleChange, when set, is the text of a script (with its #! line)
	// that Patroni runs as its on_role_change callback, with the arguments
	// action, role and scope. It runs as the postgres user, with PGHOST,
	// PGPORT and PGUSER set to the node's own unix socket directory, port
	// and superuser, and psql on PATH.
	OnRoleChange string
	// StartTimeout bounds the bootstrap. Defaults to 3 minutes.
	StartTimeout time.Duration
	// Logf receives progress lines. Defaults to discarding them.
	Logf func(format string, args ...any)
}

func (o *Options) defaults() {
	if o.Nodes == 0 {
		o.Nodes = 3
	}
	if o.TTL == 0 {
		o.TTL = 10
	}
	if o.LoopWait == 0 {
		o.LoopWait = 2
	}
	if o.RetryTimeout == 0 {
		o.RetryTimeout = 4
	}
	if o.MaximumLagOnFailover == 0 {
		o.MaximumLagOnFailover = 64 << 20
	}
	if o.StartTimeout == 0 {
		o.StartTimeout = 3 * time.Minute
	}
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
}

// Node is one PostgreSQL node and its Patroni.
type Node struct {
	// Name is the Patroni member name (n1, n2, ...).
	Name string
	// Port is PostgreSQL's TCP port on 127.0.0.1.
	Port int
	// APIPort is Patroni's REST API port on 127.0.0.1.
	APIPort int
	// Dir holds the node's files: patroni.yml, the unix socket, pgpass,
	// patroni.log, pglog/ (PostgreSQL's log) and data/.
	Dir string
	// DataDir is PostgreSQL's data directory.
	DataDir string

	configPath string
	logPath    string

	mu      sync.Mutex
	patroni *proc // nil after KillNode until StartNode
	stopped []int // pids stopped by Pause or Freeze, resumed by Resume
}

// Cluster is a running etcd + Patroni cluster.
type Cluster struct {
	opts   Options
	dir    string
	token  string
	binDir string
	cred   *syscall.Credential
	uid    int
	gid    int

	etcdPort, etcdPeerPort int
	etcd                   *proc
	nodes                  []*Node
	reaper                 *reaper
	http                   *http.Client

	// Bootstrap is how long the start took, from etcd's start to a healthy
	// cluster.
	Bootstrap time.Duration

	stopOnce sync.Once
	stopErr  error
}

// binaries found by Available.
type binaries struct {
	patroni, etcd, pgBin string
}

// Available checks that Patroni, its etcd client module, etcd and the
// PostgreSQL server binaries are installed, and says what to install when
// they are not.
func Available() error {
	_, err := findBinaries()
	return err
}

func findBinaries() (binaries, error) {
	var b binaries
	var missing []string
	b.patroni = lookup("patroni", "/usr/bin/patroni")
	if b.patroni == "" {
		missing = append(missing, "patroni (Debian package patroni)")
	} else if !pythonHasEtcd() {
		missing = append(missing, "the python etcd client Patroni's etcd DCS needs (Debian package python3-etcd)")
	}
	b.etcd = lookup("etcd", "/usr/bin/etcd")
	if b.etcd == "" {
		missing = append(missing, "etcd (Debian package etcd-server)")
	}
	b.pgBin = findPGBin()
	if b.pgBin == "" {
		missing = append(missing, "the PostgreSQL server binaries initdb, pg_ctl, pg_rewind, pg_basebackup (Debian package postgresql)")
	}
	return b, missingError(missing)
}

// missingError names what is missing and how to install it; nil if nothing is.
func missingError(missing []string) error {
	if len(missing) == 0 {
		return nil
	}
	return fmt.Errorf("hacluster: the Patroni HA tests need %s; install with: %s", strings.Join(missing, ", "), InstallHint)
}

// lookup finds a command at a fixed path first (Debian's, whose shebang is
// the system python) and then on PATH.
func lookup(name, fixed string) string {
	if fi, err := os.Stat(fixed); err == nil && fi.Mode()&0o111 != 0 {
		return fixed
	}
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	return ""
}

func pythonHasEtcd() bool {
	for _, d := range []string{"/usr/lib/python3/dist-packages/etcd", "/usr/local/lib/python3/dist-packages/etcd"} {
		if _, err := os.Stat(filepath.Join(d, "__init__.py")); err == nil {
			return true
		}
	}
	// Another installation (pip): ask the interpreter Patroni uses.
	return exec.Command("/usr/bin/python3", "-c", "import etcd").Run() == nil
}

// findPGBin returns the newest /usr/lib/postgresql/*/bin with everything
// Patroni runs, else the directory of postgres on PATH.
func findPGBin() string {
	ok := func(dir string) bool {
		for _, b := range []string{"postgres", "initdb", "pg_ctl", "pg_rewind", "pg_basebackup"} {
			if _, err := os.Stat(filepath.Join(dir, b)); err != nil {
				return false
			}
		}
		return true
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool {
		vi, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(dirs[i])), 64)
		vj, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(dirs[j])), 64)
		return vi > vj
	})
	for _, d := range dirs {
		if ok(d) {
			return d
		}
	}
	if p, err := exec.LookPath("postgres"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		if d := filepath.Dir(p); ok(d) {
			return d
		}
	}
	return ""
}

// Start starts a cluster for t and registers [Cluster.Stop] with t.Cleanup.
// It fails t (never skips it) when something is not installed or the
// cluster does not become healthy within Options.StartTimeout.
func Start(t testing.TB, opts Options) *Cluster {
	t.Helper()
	if err := Available(); err != nil {
		t.Fatal(err)
	}
	opts.defaults()
	ctx, cancel := context.WithTimeout(context.Background(), opts.StartTimeout)
	defer cancel()
	c, err := StartContext(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Stop(); err != nil {
			t.Errorf("hacluster: stop: %v", err)
		}
	})
	return c
}

// StartContext starts a cluster and waits until it is healthy. On error
// everything it started is stopped already. The caller must call
// [Cluster.Stop].
func StartContext(ctx context.Context, opts Options) (*Cluster, error) {
	opts.defaults()
	var lastErr error
	for attempt := 1; attempt <= 2; attempt++ {
		c, err := start(ctx, opts)
		if err == nil {
			return c, nil
		}
		lastErr = err
		// A port the kernel gave us may have been taken between the probe
		// and the bind; a second attempt picks new ones.
		if ctx.Err() != nil || !strings.Contains(err.Error(), "address already in use") {
			break
		}
		opts.Logf("hacluster: retrying the start: %v", err)
	}
	return nil, lastErr
}

func start(ctx context.Context, opts Options) (c *Cluster, err error) {
	bins, err := findBinaries()
	if err != nil {
		return nil, err
	}
	base, err := shortTempBase()
	if err != nil {
		return nil, err
	}
	sweepStale(base)
	dir, err := os.MkdirTemp(base, "pgfha-")
	if err != nil {
		return nil, err
	}
	c = &Cluster{
		opts:   opts,
		dir:    dir,
		token:  filepath.Base(dir),
		binDir: bins.pgBin,
		uid:    -1,
		gid:    -1,
		http:   &http.Client{Timeout: 3 * time.Second},
	}
	if c.reaper, err = startReaper(c.token, dir); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	began := time.Now()
	defer func() {
		if err != nil {
			err = fmt.Errorf("%w%s", err, c.logTails())
			if serr := c.Stop(); serr != nil {
				err = fmt.Errorf("%w; and stopping: %v", err, serr)
			}
			c = nil
		}
	}()
	if err := os.WriteFile(filepath.Join(dir, "owner.pid"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return c, err
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		return c, err
	}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return c, fmt.Errorf("hacluster: running as root needs a postgres user to run Patroni and PostgreSQL as (Debian's postgresql package creates it): %w", err)
		}
		c.uid, _ = strconv.Atoi(u.Uid)
		c.gid, _ = strconv.Atoi(u.Gid)
		c.cred = &syscall.Credential{Uid: uint32(c.uid), Gid: uint32(c.gid), NoSetGroups: true}
		if err := os.Chown(dir, c.uid, c.gid); err != nil {
			return c, err
		}
	}

	ports, err := freePorts(2 + 2*opts.Nodes)
	if err != nil {
		return c, err
	}
	c.etcdPort, c.etcdPeerPort = ports[0], ports[1]
	for i := range opts.Nodes {
		name := fmt.Sprintf("n%d", i+1)
		nd := filepath.Join(dir, name)
		c.nodes = append(c.nodes, &Node{
			Name:       name,
			APIPort:    ports[2+2*i],
			Port:       ports[3+2*i],
			Dir:        nd,
			DataDir:    filepath.Join(nd, "data"),
			configPath: filepath.Join(nd, "patroni.yml"),
			logPath:    filepath.Join(nd, "patroni.log"),
		})
	}

	if err := c.startEtcd(ctx, bins.etcd); err != nil {
		return c, err
	}
	for _, n := range c.nodes {
		if err := c.writeNodeConfig(n); err != nil {
			return c, err
		}
	}
	for _, n := range c.nodes {
		if err := c.startPatroni(n, bins.patroni); err != nil {
			return c, err
		}
	}
	if _, err := c.WaitHealthy(ctx); err != nil {
		return c, fmt.Errorf("hacluster: cluster not healthy after %v: %w", time.Since(began).Round(time.Millisecond), err)
	}
	c.Bootstrap = time.Since(began)
	opts.Logf("hacluster: %d nodes + etcd healthy in %v (dir %s, mode %s)", opts.Nodes, c.Bootstrap.Round(time.Millisecond), dir, opts.Mode)
	return c, nil
}

// shortTempBase returns a directory for the cluster whose path is short
// enough for unix socket paths and whose every parent the postgres user can
// traverse.
func shortTempBase() (string, error) {
	for _, d := range []string{os.TempDir(), "/tmp"} {
		if len(d) > 40 {
			continue
		}
		if traversable(d) {
			return d, nil
		}
	}
	return "", errors.New("hacluster: no short temporary directory that other users can traverse (tried $TMPDIR and /tmp)")
}

// traversable reports whether every directory from / to d has the execute
// bit for others (the postgres user must reach its files when we are root).
func traversable(d string) bool {
	d, err := filepath.Abs(d)
	if err != nil {
		return false
	}
	for {
		fi, err := os.Stat(d)
		if err != nil || !fi.IsDir() || (os.Geteuid() == 0 && fi.Mode().Perm()&0o001 == 0) {
			return false
		}
		parent := filepath.Dir(d)
		if parent == d {
			return true
		}
		d = parent
	}
}

// sweepStale removes the directories (and kills the processes) of clusters
// whose test process died without its watchdog finishing the job.
func sweepStale(base string) {
	dirs, _ := filepath.Glob(filepath.Join(base, "pgfha-*"))
	for _, d := range dirs {
		b, err := os.ReadFile(filepath.Join(d, "owner.pid"))
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || alive(pid) {
			continue
		}
		token := filepath.Base(d)
		for _, p := range processesWith(token) {
			_ = syscall.Kill(p.PID, syscall.SIGCONT)
			_ = syscall.Kill(p.PID, syscall.SIGKILL)
		}
		_ = os.RemoveAll(d)
	}
}

// freePorts returns n distinct ports that are free on 127.0.0.1 now. The
// kernel is asked for each: a port is taken only if binding it succeeds, and
// all n listeners are held open together, then closed. Candidates come from
// below the kernel's ephemeral range (ip_local_port_range), at random: a port
// that bind(0) hands out is in that range and stays free only until
// Patroni and PostgreSQL bind it seconds later, while every outgoing
// connection of every process on the machine (the other test binaries open
// thousands) takes its local port from the same range. Below it, only a
// process that binds a fixed port can collide. If the range cannot be read
// or leaves no room, the kernel picks (bind to port 0).
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	lo := ephemeralLow()
	var ports []int
	for attempts := 0; len(ports) < n && attempts < 2000; attempts++ {
		port := 0
		if lo > 12000 {
			port = 10000 + rand.IntN(lo-10000)
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			if port == 0 {
				return nil, err
			}
			continue
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	if len(ports) < n {
		return nil, fmt.Errorf("hacluster: found only %d free ports of %d", len(ports), n)
	}
	return ports, nil
}

// ephemeralLow returns the lowest port of the kernel's ephemeral range, or 0.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return 0
	}
	lo, _ := strconv.Atoi(f[0])
	return lo
}

func (c *Cluster) startEtcd(ctx context.Context, etcdBin string) error {
	dataDir := filepath.Join(c.dir, "etcd")
	client := fmt.Sprintf("http://127.0.0.1:%d", c.etcdPort)
	peer := fmt.Sprintf("http://127.0.0.1:%d", c.etcdPeerPort)
	args := []string{
		"--name", "e1",
		"--data-dir", dataDir,
		"--listen-client-urls", client,
		"--advertise-client-urls", client,
		"--listen-peer-urls", peer,
		"--initial-advertise-peer-urls", peer,
		"--initial-cluster", "e1=" + peer,
		"--initial-cluster-state", "new",
		"--initial-cluster-token", c.token,
		"--enable-v2=true",
		"--log-level", "warn",
	}
	p, err := startProc("etcd", etcdBin, args, c.dir, []string{"PATH=/usr/bin:/bin", "HOME=" + c.dir}, nil, filepath.Join(c.dir, "etcd.log"))
	if err != nil {
		return err
	}
	c.etcd = p
	// Healthy when the v2 keys API answers (Patroni's etcd: DCS uses it).
	deadline := time.Now().Add(60 * time.Second)
	for {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, client+"/v2/keys/", nil)
		resp, err := c.http.Do(req)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("GET /v2/keys/: %s", resp.Status)
		}
		if p.exited() {
			return fmt.Errorf("etcd exited during startup: %s", tail(filepath.Join(c.dir, "etcd.log"), 15))
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("etcd not ready: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// parameters returns the PostgreSQL settings every node gets.
func (c *Cluster) parameters() map[string]any {
	p := map[string]any{
		"max_connections":       100,
		"max_wal_senders":       10,
		"max_replication_slots": 10,
		"wal_level":             "replica",
		"hot_standby":           "on",
		"wal_log_hints":         "on",
		"wal_keep_size":         "128MB",
		"shared_buffers":        "32MB",
		// Only processes are killed in these tests, never the machine:
		// the page cache survives, so fsync buys nothing but I/O waits.
		// full_page_writes stays on (pg_rewind needs it).
		"fsync":            "off",
		"lc_messages":      "C",
		"log_line_prefix":  "%m [%p] %q%u@%d ",
		"log_min_messages": "warning",
	}
	for k, v := range c.opts.Parameters {
		p[k] = v
	}
	return p
}

func (c *Cluster) writeNodeConfig(n *Node) error {
	if err := os.MkdirAll(filepath.Join(n.Dir, "pglog"), 0o755); err != nil {
		return err
	}
	if c.cred != nil {
		for _, d := range []string{n.Dir, filepath.Join(n.Dir, "pglog")} {
			if err := os.Chown(d, c.uid, c.gid); err != nil {
				return err
			}
		}
	}
	local := map[string]any{
		"unix_socket_directories": n.Dir,
		"logging_collector":       "on",
		"log_directory":           filepath.Join(n.Dir, "pglog"),
		"log_filename":            "postgresql-%Y%m%d-%H%M%S.log",
	}
	pg := map[string]any{
		"listen":          fmt.Sprintf("127.0.0.1:%d", n.Port),
		"connect_address": fmt.Sprintf("127.0.0.1:%d", n.Port),
		"data_dir":        n.DataDir,
		"bin_dir":         c.binDir,
		// Each node its own pgpass: the default (~postgres/.pgpass) would be
		// rewritten by the three Patronis at once.
		"pgpass": filepath.Join(n.Dir, "pgpass"),
		"authentication": map[string]any{
			"superuser":   map[string]any{"username": "postgres", "password": "pgfence"},
			"replication": map[string]any{"username": "replicator", "password": "pgfence"},
		},
		"parameters": local,
		"pg_hba": []string{
			"local all all trust",
			"local replication all trust",
			"host all all 127.0.0.1/32 trust",
			"host replication all 127.0.0.1/32 trust",
		},
		"basebackup": []any{map[string]any{"checkpoint": "fast"}, "no-sync"},
		"remove_data_directory_on_rewind_failure":     true,
		"remove_data_directory_on_diverged_timelines": true,
	}
	if c.opts.OnRoleChange != "" {
		script := filepath.Join(c.dir, "on_role_change")
		if err := os.WriteFile(script, []byte(c.opts.OnRoleChange), 0o755); err != nil {
			return err
		}
		pg["callbacks"] = map[string]any{"on_role_change": script}
	}
	cfg := map[string]any{
		"scope":     c.token,
		"namespace": "/pgfence/",
		"name":      n.Name,
		"log":       map[string]any{"level": "INFO"},
		"restapi": map[string]any{
			"listen":          fmt.Sprintf("127.0.0.1:%d", n.APIPort),
			"connect_address": fmt.Sprintf("127.0.0.1:%d", n.APIPort),
		},
		"etcd": map[string]any{"host": fmt.Sprintf("127.0.0.1:%d", c.etcdPort), "protocol": "http"},
		"bootstrap": map[string]any{
			"dcs": map[string]any{
				"ttl":                     c.opts.TTL,
				"loop_wait":               c.opts.LoopWait,
				"retry_timeout":           c.opts.RetryTimeout,
				"maximum_lag_on_failover": c.opts.MaximumLagOnFailover,
				"primary_start_timeout":   c.opts.PrimaryStartTimeout,
				"synchronous_mode":        c.opts.Mode != Async,
				"synchronous_mode_strict": c.opts.Mode == SyncStrict,
				"postgresql": map[string]any{
					"use_pg_rewind": true,
					"use_slots":     true,
					"parameters":    c.parameters(),
				},
			},
			// no-sync: the throwaway cluster needs no fsync of its new files.
			"initdb": []any{"data-checksums", "no-sync", map[string]any{"encoding": "UTF8"}, map[string]any{"locale": "C"}},
		},
		"postgresql": pg,
	}
	// YAML is a superset of JSON: Patroni reads this file as it is.
	b, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(n.configPath, b, 0o644); err != nil {
		return err
	}
	if c.cred != nil {
		return os.Chown(n.configPath, c.uid, c.gid)
	}
	return nil
}

func (c *Cluster) startPatroni(n *Node, patroniBin string) error {
	env := []string{
		"PATH=" + c.binDir + ":/usr/bin:/bin",
		"HOME=" + n.Dir,
		"LANG=C.UTF-8",
		"PYTHONUNBUFFERED=1",
		// For callbacks: the node's own server.
		"PGHOST=" + n.Dir,
		"PGPORT=" + strconv.Itoa(n.Port),
		"PGUSER=postgres",
	}
	p, err := startProc("patroni "+n.Name, patroniBin, []string{n.configPath}, n.Dir, env, c.cred, n.logPath)
	if err != nil {
		return err
	}
	n.mu.Lock()
	n.patroni = p
	n.mu.Unlock()
	return nil
}

// Dir returns the cluster's directory.
func (c *Cluster) Dir() string { return c.dir }

// Token returns the string every process of the cluster carries in its
// command line (the directory's name, also PostgreSQL's cluster_name).
func (c *Cluster) Token() string { return c.token }

// Mode returns the replication mode the cluster was started with or last
// set with [Cluster.SetMode].
func (c *Cluster) Mode() Mode { return c.opts.Mode }

// Nodes returns the nodes.
func (c *Cluster) Nodes() []*Node { return c.nodes }

// Node returns the node named name, or nil.
func (c *Cluster) Node(name string) *Node {
	for _, n := range c.nodes {
		if n.Name == name {
			return n
		}
	}
	return nil
}

// DSN returns the URL form of the multi-host connection string clients use:
// every node, target_session_attrs=read-write (libpq and pgx try the hosts
// in order and keep the first that accepts writes), connect_timeout=2 (the
// per-host bound: a paused host still accepts TCP connections and would
// otherwise hold the connection attempt).
func (c *Cluster) DSN(db string) string {
	hosts := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		hosts[i] = fmt.Sprintf("127.0.0.1:%d", n.Port)
	}
	q := url.Values{}
	q.Set("target_session_attrs", "read-write")
	q.Set("connect_timeout", "2")
	q.Set("sslmode", "disable")
	return fmt.Sprintf("postgres://postgres@%s/%s?%s", strings.Join(hosts, ","), url.PathEscape(db), q.Encode())
}

// KeywordDSN returns the same connection string in keyword/value form:
// host=127.0.0.1,127.0.0.1,127.0.0.1 port=a,b,c target_session_attrs=read-write.
func (c *Cluster) KeywordDSN(db string) string {
	hosts := make([]string, len(c.nodes))
	ports := make([]string, len(c.nodes))
	for i, n := range c.nodes {
		hosts[i] = "127.0.0.1"
		ports[i] = strconv.Itoa(n.Port)
	}
	return fmt.Sprintf("host=%s port=%s dbname=%s user=postgres target_session_attrs=read-write connect_timeout=2 sslmode=disable",
		strings.Join(hosts, ","), strings.Join(ports, ","), db)
}

// NodeDSN returns a connection string to one node only.
func (c *Cluster) NodeDSN(name, db string) string {
	n := c.Node(name)
	if n == nil {
		return ""
	}
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable&connect_timeout=2", n.Port, url.PathEscape(db))
}

// Members returns GET /cluster as seen by the first node that answers
// (nodes that are paused or killed do not).
func (c *Cluster) Members(ctx context.Context) ([]Member, error) {
	var lastErr error
	for _, n := range c.nodes {
		if !n.reachable() {
			continue
		}
		var v clusterView
		if err := c.getJSON(ctx, n, "/cluster", &v); err != nil {
			lastErr = err
			continue
		}
		return v.Members, nil
	}
	if lastErr == nil {
		lastErr = errors.New("no node's REST API is reachable")
	}
	return nil, lastErr
}

// bindConflict reports whether n's Patroni or PostgreSQL could not bind its
// port.
func (n *Node) bindConflict() bool {
	logs, _ := filepath.Glob(filepath.Join(n.Dir, "pglog", "*.log"))
	for _, p := range append(logs, n.logPath) {
		if b, err := os.ReadFile(p); err == nil && strings.Contains(string(b), "ddress already in use") {
			return true
		}
	}
	return false
}

// reachable reports whether n's Patroni runs and is not paused.
func (n *Node) reachable() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.patroni != nil && !n.patroni.exited() && len(n.stopped) == 0
}

// Leader returns the name of the member holding the leader key, or "" when
// the cluster has none at the moment.
func (c *Cluster) Leader(ctx context.Context) (string, error) {
	ms, err := c.Members(ctx)
	if err != nil {
		return "", err
	}
	for _, m := range ms {
		if m.Role == "leader" {
			return m.Name, nil
		}
	}
	return "", nil
}

// Status returns GET /patroni of node name.
func (c *Cluster) Status(ctx context.Context, name string) (NodeStatus, error) {
	n := c.Node(name)
	if n == nil {
		return NodeStatus{}, fmt.Errorf("no node %q", name)
	}
	var s NodeStatus
	err := c.getJSON(ctx, n, "/patroni", &s)
	return s, err
}

// Health is a snapshot of a healthy cluster.
type Health struct {
	Leader      string
	SyncStandby string // "" in Async mode
	Timeline    int
}

// WaitHealthy waits until one leader holds the key, its PostgreSQL accepts
// writes, every other node streams from it, and (in the synchronous modes) a
// standby is synchronous. It polls the REST API until ctx ends.
func (c *Cluster) WaitHealthy(ctx context.Context) (Health, error) {
	var last error
	for {
		h, err := c.healthy(ctx)
		if err == nil {
			return h, nil
		}
		if last == nil || err.Error() != last.Error() {
			c.opts.Logf("hacluster: %s waiting: %v", time.Now().Format("15:04:05.000"), err)
		}
		last = err
		for _, n := range c.nodes {
			n.mu.Lock()
			dead := n.patroni != nil && n.patroni.exited()
			n.mu.Unlock()
			if dead {
				return Health{}, fmt.Errorf("patroni of %s exited: %s", n.Name, tail(n.logPath, 20))
			}
			if c.Bootstrap == 0 && n.bindConflict() {
				return Health{}, fmt.Errorf("node %s: address already in use (another process took a port): %s", n.Name, tail(n.logPath, 10))
			}
		}
		select {
		case <-ctx.Done():
			return Health{}, fmt.Errorf("%w (last: %v)", ctx.Err(), last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func (c *Cluster) healthy(ctx context.Context) (Health, error) {
	ms, err := c.Members(ctx)
	if err != nil {
		return Health{}, err
	}
	if len(ms) != len(c.nodes) {
		return Health{}, fmt.Errorf("%d of %d members registered", len(ms), len(c.nodes))
	}
	var h Health
	for _, m := range ms {
		switch m.Role {
		case "leader":
			h.Leader = m.Name
		case "sync_standby":
			h.SyncStandby = m.Name
		}
	}
	if h.Leader == "" {
		return Health{}, errors.New("no leader")
	}
	st, err := c.Status(ctx, h.Leader)
	if err != nil {
		return Health{}, err
	}
	if !isPrimary(st.Role) || st.State != "running" {
		return Health{}, fmt.Errorf("leader %s: role %s, state %s", h.Leader, st.Role, st.State)
	}
	h.Timeline = st.Timeline
	streaming, sync := 0, 0
	for _, r := range st.Replication {
		if r.State == "streaming" {
			streaming++
			if r.SyncState == "sync" || r.SyncState == "quorum" {
				sync++
			}
		}
	}
	if streaming != len(c.nodes)-1 {
		return Health{}, fmt.Errorf("leader %s: %d of %d replicas streaming", h.Leader, streaming, len(c.nodes)-1)
	}
	if c.opts.Mode != Async && (sync == 0 || h.SyncStandby == "") {
		return Health{}, fmt.Errorf("leader %s: no synchronous standby yet", h.Leader)
	}
	if c.opts.Mode == Async && sync > 0 {
		return Health{}, fmt.Errorf("leader %s: still has a synchronous standby in async mode", h.Leader)
	}
	for _, m := range ms {
		if m.Name != h.Leader && m.State != "running" && m.State != "streaming" {
			return Health{}, fmt.Errorf("member %s: state %s", m.Name, m.State)
		}
	}
	// The leader's PostgreSQL must take writes.
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(cctx, c.NodeDSN(h.Leader, "postgres"))
	if err != nil {
		return Health{}, fmt.Errorf("leader %s: %w", h.Leader, err)
	}
	defer conn.Close(context.Background())
	var ro string
	if err := conn.QueryRow(cctx, "SHOW transaction_read_only").Scan(&ro); err != nil {
		return Health{}, fmt.Errorf("leader %s: %w", h.Leader, err)
	}
	if ro != "off" {
		return Health{}, fmt.Errorf("leader %s: read-only", h.Leader)
	}
	return h, nil
}

// Switchover asks Patroni (POST /switchover on the leader's REST API, what
// patronictl switchover does) to hand the leader role to candidate, or to
// the synchronous standby (any streaming replica in Async mode) when
// candidate is "". It returns when Patroni reports the new leader.
func (c *Cluster) Switchover(ctx context.Context, candidate string) (from, to string, err error) {
	h, err := c.healthy(ctx)
	if err != nil {
		return "", "", fmt.Errorf("switchover needs a healthy cluster: %w", err)
	}
	if candidate == "" {
		candidate = h.SyncStandby
		if candidate == "" {
			for _, n := range c.nodes {
				if n.Name != h.Leader {
					candidate = n.Name
					break
				}
			}
		}
	}
	for attempt := 1; ; attempt++ {
		code, body, err := c.send(ctx, http.MethodPost, c.Node(h.Leader), "/switchover",
			map[string]string{"leader": h.Leader, "candidate": candidate}, 90*time.Second)
		if err == nil && code == http.StatusOK {
			return h.Leader, candidate, nil
		}
		// Patroni answers 503 "Switchover status unknown" when the new
		// leader took longer than its own 20 s poll (a loaded machine), and
		// the request may have been cut: see who leads now.
		deadline := time.Now().Add(2 * time.Minute)
		for time.Now().Before(deadline) && ctx.Err() == nil {
			l, lerr := c.Leader(ctx)
			if lerr == nil && l != "" && l != h.Leader {
				return h.Leader, l, nil
			}
			if lerr == nil && l == h.Leader && (code == http.StatusPreconditionFailed || strings.Contains(body, "failed")) {
				break // refused or failed: the old leader kept the key
			}
			time.Sleep(200 * time.Millisecond)
		}
		if attempt == 3 || ctx.Err() != nil {
			if err == nil {
				err = fmt.Errorf("%d %s", code, body)
			}
			return h.Leader, candidate, fmt.Errorf("POST /switchover %s → %s: %w", h.Leader, candidate, err)
		}
		c.opts.Logf("hacluster: switchover %s → %s: %d %s %v; trying again", h.Leader, candidate, code, body, err)
		if h, err = c.WaitHealthy(ctx); err != nil {
			return "", "", err
		}
		if h.SyncStandby != "" {
			candidate = h.SyncStandby
		}
	}
}

// SetMode changes the replication mode through PATCH /config and waits
// until the cluster is healthy in it.
func (c *Cluster) SetMode(ctx context.Context, m Mode) error {
	l, err := c.Leader(ctx)
	if err != nil || l == "" {
		return fmt.Errorf("set mode: no leader: %v", err)
	}
	code, body, err := c.send(ctx, http.MethodPatch, c.Node(l), "/config",
		map[string]any{"synchronous_mode": m != Async, "synchronous_mode_strict": m == SyncStrict}, 10*time.Second)
	if err != nil {
		return err
	}
	if code != http.StatusOK {
		return fmt.Errorf("PATCH /config: %d %s", code, body)
	}
	c.opts.Mode = m
	_, err = c.WaitHealthy(ctx)
	return err
}

// PostmasterPID returns the pid of node name's postmaster, verified.
func (c *Cluster) PostmasterPID(name string) (int, error) {
	n := c.Node(name)
	if n == nil {
		return 0, fmt.Errorf("no node %q", name)
	}
	return postmasterPID(n.DataDir)
}

// KillPostmaster sends SIGKILL to node name's postmaster (read from
// postmaster.pid and verified). Its backends notice their postmaster's
// death and exit; Patroni, with primary_start_timeout 0, fails over.
func (c *Cluster) KillPostmaster(name string) error {
	pid, err := c.PostmasterPID(name)
	if err != nil {
		return err
	}
	return syscall.Kill(pid, syscall.SIGKILL)
}

// KillNode kills node name as a crashed machine would end: SIGKILL to its
// Patroni, its postmaster and every child of the postmaster at once. The
// node stays down until [Cluster.StartNode].
func (c *Cluster) KillNode(name string) error {
	n := c.Node(name)
	if n == nil {
		return fmt.Errorf("no node %q", name)
	}
	n.mu.Lock()
	p := n.patroni
	n.patroni = nil
	n.stopped = nil
	n.mu.Unlock()
	var pids []int
	if pm, err := postmasterPID(n.DataDir); err == nil {
		pids = append([]int{pm}, childrenOf(pm)...)
	}
	if p != nil {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
	}
	for _, pid := range pids {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
	if p != nil {
		if err := p.kill(10 * time.Second); err != nil {
			return err
		}
	}
	return nil
}

// StartNode starts node name's Patroni again after [Cluster.KillNode]. It
// does not wait: Patroni starts PostgreSQL as a replica (with pg_rewind
// when needed); use [Cluster.WaitHealthy].
func (c *Cluster) StartNode(name string) error {
	n := c.Node(name)
	if n == nil {
		return fmt.Errorf("no node %q", name)
	}
	n.mu.Lock()
	running := n.patroni != nil && !n.patroni.exited()
	n.mu.Unlock()
	if running {
		return fmt.Errorf("patroni of %s is running", name)
	}
	bins, err := findBinaries()
	if err != nil {
		return err
	}
	return c.startPatroni(n, bins.patroni)
}

// Pause stops node name's Patroni and postmaster with SIGSTOP. The
// postmaster's children (backends, WAL senders) keep running: existing
// connections keep working, new ones wait. Resume with [Cluster.Resume].
func (c *Cluster) Pause(name string) error { return c.sigstop(name, false) }

// Freeze stops node name entirely with SIGSTOP, as a stalled virtual machine
// would be: Patroni, the postmaster and all its children. Resume with
// [Cluster.Resume].
func (c *Cluster) Freeze(name string) error { return c.sigstop(name, true) }

func (c *Cluster) sigstop(name string, children bool) error {
	n := c.Node(name)
	if n == nil {
		return fmt.Errorf("no node %q", name)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.patroni == nil || n.patroni.exited() {
		return fmt.Errorf("patroni of %s is not running", name)
	}
	pm, err := postmasterPID(n.DataDir)
	if err != nil {
		return err
	}
	pids := []int{n.patroni.pid(), pm}
	if children {
		pids = append(pids, childrenOf(pm)...)
	}
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			return fmt.Errorf("SIGSTOP %d: %w", pid, err)
		}
		n.stopped = append(n.stopped, pid)
	}
	return nil
}

// Resume sends SIGCONT to what [Cluster.Pause] or [Cluster.Freeze] stopped,
// PostgreSQL's processes first and Patroni last.
func (c *Cluster) Resume(name string) error {
	n := c.Node(name)
	if n == nil {
		return fmt.Errorf("no node %q", name)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	for i := len(n.stopped) - 1; i >= 0; i-- {
		_ = syscall.Kill(n.stopped[i], syscall.SIGCONT)
	}
	n.stopped = nil
	return nil
}

// Stop kills everything the cluster started and verifies that nothing is
// left: Patroni (SIGKILL, so it restarts nothing), each postmaster (found
// through postmaster.pid and verified; SIGQUIT, PostgreSQL's immediate
// shutdown), etcd, then any process still carrying the cluster's token
// (SIGKILL). It removes the directory. Safe to call more than once.
func (c *Cluster) Stop() error {
	c.stopOnce.Do(func() { c.stopErr = c.stopAll() })
	return c.stopErr
}

func (c *Cluster) stopAll() error {
	var errs []error
	for _, n := range c.nodes {
		n.mu.Lock()
		for _, pid := range n.stopped {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
		n.stopped = nil
		p := n.patroni
		n.mu.Unlock()
		if p != nil {
			if err := p.kill(15 * time.Second); err != nil {
				errs = append(errs, err)
			}
		}
	}
	var pms []int
	for _, n := range c.nodes {
		if pid, err := postmasterPID(n.DataDir); err == nil {
			for _, ch := range childrenOf(pid) {
				_ = syscall.Kill(ch, syscall.SIGCONT)
			}
			_ = syscall.Kill(pid, syscall.SIGCONT)
			_ = syscall.Kill(pid, syscall.SIGQUIT)
			pms = append(pms, pid)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, pid := range pms {
		for alive(pid) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
	}
	if c.etcd != nil {
		if err := c.etcd.kill(15 * time.Second); err != nil {
			errs = append(errs, err)
		}
	}
	// Whatever still carries the token (a postmaster that ignored SIGQUIT,
	// an orphaned backend, a callback): SIGKILL, and wait for it to go.
	var left []procInfo
	deadline = time.Now().Add(30 * time.Second)
	for {
		left = processesWith(c.token)
		if len(left) == 0 || time.Now().After(deadline) {
			break
		}
		for _, p := range left {
			_ = syscall.Kill(p.PID, syscall.SIGCONT)
			_ = syscall.Kill(p.PID, syscall.SIGKILL)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if len(left) > 0 {
		var s []string
		for _, p := range left {
			s = append(s, fmt.Sprintf("%d %c %s", p.PID, p.State, p.Cmdline))
		}
		errs = append(errs, fmt.Errorf("processes still running after stop: %s", strings.Join(s, "; ")))
	}
	if c.reaper != nil {
		c.reaper.finish(len(left) == 0)
	}
	if err := os.RemoveAll(c.dir); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Leftovers lists processes still carrying the cluster's token (none after
// a successful Stop).
func (c *Cluster) Leftovers() []string {
	var s []string
	for _, p := range processesWith(c.token) {
		s = append(s, fmt.Sprintf("%d %s", p.PID, p.Cmdline))
	}
	return s
}

// Logs returns the last lines of every node's Patroni log, for failure
// messages.
func (c *Cluster) Logs(lines int) string {
	var b strings.Builder
	for _, n := range c.nodes {
		fmt.Fprintf(&b, "\n--- %s patroni.log (last %d lines):\n%s", n.Name, lines, tail(n.logPath, lines))
		pgl, _ := filepath.Glob(filepath.Join(n.Dir, "pglog", "*.log"))
		sort.Strings(pgl)
		if len(pgl) > 0 {
			fmt.Fprintf(&b, "\n--- %s %s (last %d lines):\n%s", n.Name, filepath.Base(pgl[len(pgl)-1]), lines, tail(pgl[len(pgl)-1], lines))
		}
	}
	return b.String()
}

func (c *Cluster) logTails() string {
	if len(c.nodes) == 0 {
		return "\n--- etcd.log:\n" + tail(filepath.Join(c.dir, "etcd.log"), 20)
	}
	return c.Logs(25)
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(%v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
