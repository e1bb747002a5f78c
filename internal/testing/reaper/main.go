// Command reaper stands in for testcontainers' reaper, Ryuk, in pgfence's CI,
// where no registry can be reached and Ryuk's image cannot be pulled. It is
// built static and put in an image of its own by scripts/docker-engine.sh;
// it is nobody's dependency and never runs outside that image.
//
// It speaks Ryuk's protocol as testcontainers-go (v0.45) uses it:
//
//   - it listens on TCP port RYUK_PORT (default 8080) and prints a line
//     containing "Started" once it does (testcontainers waits for that line);
//   - each client sends lines of label filters in URL query form, such as
//     "label=org.testcontainers.sessionId=ab12&label=org.testcontainers.reap=true",
//     and gets "ACK\n" for each line it accepted;
//   - once the last client has disconnected and RYUK_RECONNECTION_TIMEOUT
//     (default 10s) has passed without a new one, it removes the containers
//     (forced, with their anonymous volumes), networks, volumes and images
//     that match any of the filters it received, and exits. A resource of a
//     filter created in the last second postpones that by one more period, so
//     that what a client is still setting up is not taken from it;
//   - when no client connects within RYUK_CONNECTION_TIMEOUT (default 1m) it
//     exits; on SIGTERM or SIGINT it stops accepting clients and removes what
//     it knows of at once if no client is connected, or when the last one has
//     left, or after RYUK_SHUTDOWN_TIMEOUT (default 10m).
//
// Containers labelled org.testcontainers.ryuk=true (reapers) are never
// removed, and a filter line without a label filter is refused ("ERR\n"):
// it would match every resource of the engine.
//
// It talks to the Docker engine API over the unix socket mounted at
// /var/run/docker.sock (DOCKER_HOST=unix:///path overrides it), with the
// standard library only. Other settings: RYUK_REQUEST_TIMEOUT (10s) bounds
// each API request, RYUK_REMOVE_RETRIES (10) the attempts to remove one
// resource, RYUK_VERBOSE=true logs every resource found.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// ryukLabel marks a reaper container; reapers are never removed.
const ryukLabel = "org.testcontainers.ryuk"

// changeWindow: a matching resource created less than this before a prune
// check postpones the prune (Ryuk's RYUK_RETRY_OFFSET of -1s).
const changeWindow = time.Second

type config struct {
	port                int
	connectionTimeout   time.Duration
	reconnectionTimeout time.Duration
	requestTimeout      time.Duration
	shutdownTimeout     time.Duration
	removeRetries       int
	verbose             bool
}

func loadConfig(getenv func(string) string) (config, error) {
	cfg := config{
		port:                8080,
		connectionTimeout:   time.Minute,
		reconnectionTimeout: 10 * time.Second,
		requestTimeout:      10 * time.Second,
		shutdownTimeout:     10 * time.Minute,
		removeRetries:       10,
	}
	durations := []struct {
		name string
		dst  *time.Duration
	}{
		{"RYUK_CONNECTION_TIMEOUT", &cfg.connectionTimeout},
		{"RYUK_RECONNECTION_TIMEOUT", &cfg.reconnectionTimeout},
		{"RYUK_REQUEST_TIMEOUT", &cfg.requestTimeout},
		{"RYUK_SHUTDOWN_TIMEOUT", &cfg.shutdownTimeout},
	}
	for _, d := range durations {
		if v := getenv(d.name); v != "" {
			x, err := time.ParseDuration(v)
			if err != nil || x <= 0 {
				return cfg, fmt.Errorf("%s=%q: want a positive duration such as 10s", d.name, v)
			}
			*d.dst = x
		}
	}
	ints := []struct {
		name     string
		dst      *int
		min, max int
	}{
		{"RYUK_PORT", &cfg.port, 1, 65535},
		{"RYUK_REMOVE_RETRIES", &cfg.removeRetries, 1, 1000},
	}
	for _, n := range ints {
		if v := getenv(n.name); v != "" {
			x, err := strconv.Atoi(v)
			if err != nil || x < n.min || x > n.max {
				return cfg, fmt.Errorf("%s=%q: want an integer in [%d, %d]", n.name, v, n.min, n.max)
			}
			*n.dst = x
		}
	}
	if v := getenv("RYUK_VERBOSE"); v != "" {
		b, err := strconv.ParseBool(v)
		if err != nil {
			return cfg, fmt.Errorf("RYUK_VERBOSE=%q: want true or false", v)
		}
		cfg.verbose = b
	}
	return cfg, nil
}

// socketPath returns the Docker socket: DOCKER_HOST if it is a unix URL,
// else /var/run/docker.sock.
func socketPath(getenv func(string) string) (string, error) {
	h := getenv("DOCKER_HOST")
	if h == "" {
		return "/var/run/docker.sock", nil
	}
	if p, ok := strings.CutPrefix(h, "unix://"); ok && p != "" {
		return p, nil
	}
	return "", fmt.Errorf("DOCKER_HOST=%q: only unix:///path is supported", h)
}

func main() {
	logger := log.New(os.Stdout, "reaper: ", log.LstdFlags|log.Lmicroseconds)
	cfg, err := loadConfig(os.Getenv)
	if err != nil {
		logger.Fatal(err)
	}
	sock, err := socketPath(os.Getenv)
	if err != nil {
		logger.Fatal(err)
	}
	api := newDockerAPI(sock, cfg.requestTimeout)
	if err := api.ping(context.Background()); err != nil {
		logger.Fatalf("docker API at %s: %v", sock, err)
	}
	ln, err := net.Listen("tcp", ":"+strconv.Itoa(cfg.port))
	if err != nil {
		logger.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	r := newReaper(cfg, api, ln, logger)
	logger.Printf("Started: listening on %s (connection timeout %s, reconnection timeout %s)",
		ln.Addr(), cfg.connectionTimeout, cfg.reconnectionTimeout)
	if err := r.run(ctx); err != nil {
		logger.Printf("done with errors: %v", err)
		os.Exit(1)
	}
	logger.Print("done")
}

// filterSet is one client line: filter name → values, all of which must
// match (Docker's semantics for several label filters).
type filterSet map[string][]string

// parseFilters parses a line such as "label=a=b&label=c=d".
func parseFilters(line string) (filterSet, error) {
	q, err := url.ParseQuery(line)
	if err != nil {
		return nil, fmt.Errorf("parse %q: %w", line, err)
	}
	f := filterSet{}
	for name, values := range q {
		for _, v := range values {
			if name == "" || v == "" {
				return nil, fmt.Errorf("parse %q: empty filter name or value", line)
			}
			f[name] = append(f[name], v)
		}
	}
	if len(f["label"]) == 0 {
		return nil, fmt.Errorf("filter %q has no label filter: it would match every resource", line)
	}
	for _, v := range f {
		sort.Strings(v)
	}
	return f, nil
}

// key is a canonical form of f, to keep each filter set once.
func (f filterSet) key() string {
	return string(f.json())
}

// json is f in the Docker API's filters form, {"label":{"a=b":true}}.
func (f filterSet) json() []byte {
	m := make(map[string]map[string]bool, len(f))
	for name, values := range f {
		m[name] = make(map[string]bool, len(values))
		for _, v := range values {
			m[name][v] = true
		}
	}
	b, err := json.Marshal(m) // sorted keys: canonical
	if err != nil {
		panic(err) // maps of strings always marshal
	}
	return b
}

// reaper tracks clients and filters and prunes when the last client is gone.
type reaper struct {
	cfg    config
	api    *dockerAPI
	ln     net.Listener
	log    *log.Logger
	joined chan net.Conn // a client connected (unbuffered: run counts it before it is served)
	left   chan struct{} // a client disconnected
	closed chan struct{} // run returned
	mu     sync.Mutex    // guards filters
	filter map[string]filterSet
}

func newReaper(cfg config, api *dockerAPI, ln net.Listener, logger *log.Logger) *reaper {
	return &reaper{
		cfg:    cfg,
		api:    api,
		ln:     ln,
		log:    logger,
		joined: make(chan net.Conn),
		left:   make(chan struct{}),
		closed: make(chan struct{}),
		filter: map[string]filterSet{},
	}
}

// run serves clients until a prune condition is met, prunes and returns.
// It closes the listener.
func (r *reaper) run(ctx context.Context) error {
	defer close(r.closed)
	var stopAccepting sync.Once
	stop := func() { stopAccepting.Do(func() { _ = r.ln.Close() }) }
	defer stop()
	go r.accept()

	clients := 0
	timer := time.NewTimer(r.cfg.connectionTimeout)
	defer timer.Stop()
	done := ctx.Done()
	signalled := false
	for {
		select {
		case c := <-r.joined:
			clients++
			if clients == 1 {
				timer.Stop()
			}
			r.log.Printf("client %s connected (%d connected)", c.RemoteAddr(), clients)
			go r.serve(c)
		case <-r.left:
			clients--
			r.log.Printf("client disconnected (%d connected)", clients)
			if clients == 0 {
				wait := r.cfg.reconnectionTimeout
				if signalled { // nobody else is waited for
					wait = time.Nanosecond
				}
				timer.Reset(wait)
			}
		case <-done:
			done, signalled = nil, true
			stop()
			wait := r.cfg.shutdownTimeout
			if clients == 0 {
				wait = time.Nanosecond
			}
			r.log.Printf("signal: no new clients; pruning in %s (%d connected)", wait, clients)
			timer.Stop()
			timer.Reset(wait)
		case now := <-timer.C:
			if clients > 0 {
				r.log.Printf("shutdown timeout with %d clients still connected", clients)
			}
			res, err := r.resources(now.Add(-changeWindow))
			if errors.Is(err, errChanged) && !signalled {
				r.log.Printf("%v; waiting %s more", err, r.cfg.reconnectionTimeout)
				timer.Reset(r.cfg.reconnectionTimeout)
				continue
			}
			stop()
			if err != nil && !errors.Is(err, errChanged) {
				return err
			}
			return r.prune(res)
		}
	}
}

// accept hands each new connection to run, until the listener is closed.
func (r *reaper) accept() {
	for {
		c, err := r.ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				r.log.Printf("accept: %v", err)
			}
			return
		}
		select {
		case r.joined <- c:
		case <-r.closed:
			// Pruning: closing without an ACK makes the client start another reaper.
			_ = c.Close()
			return
		}
	}
}

// serve reads the client's filter lines until it disconnects.
func (r *reaper) serve(c net.Conn) {
	defer func() {
		_ = c.Close()
		select {
		case r.left <- struct{}{}:
		case <-r.closed:
		}
	}()
	sc := bufio.NewScanner(c)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		reply := "ACK\n"
		f, err := parseFilters(line)
		if err != nil {
			r.log.Printf("client %s: refused: %v", c.RemoteAddr(), err)
			reply = "ERR\n"
		} else {
			r.mu.Lock()
			r.filter[f.key()] = f
			r.mu.Unlock()
			r.log.Printf("client %s: filter %s", c.RemoteAddr(), f.json())
		}
		if _, err := io.WriteString(c, reply); err != nil {
			r.log.Printf("client %s: %v", c.RemoteAddr(), err)
			return
		}
	}
}

func (r *reaper) filters() []filterSet {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]filterSet, 0, len(r.filter))
	for _, f := range r.filter {
		out = append(out, f)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].key() < out[j].key() })
	return out
}

// targets lists what a prune removes, each kind in removal order.
type targets struct {
	containers, networks, volumes, images []string
}

var errChanged = errors.New("a matching resource was created since the prune check began")

// resources lists the resources matching the filters. It returns errChanged
// (with what it found) when one of them was created after since.
func (r *reaper) resources(since time.Time) (targets, error) {
	var out targets
	seen := map[string]bool{}
	add := func(list *[]string, kind, id string) {
		if !seen[kind+"/"+id] {
			seen[kind+"/"+id] = true
			*list = append(*list, id)
		}
	}
	var errs []error
	changed := func(kind, id string, created time.Time) {
		if created.After(since) {
			errs = append(errs, fmt.Errorf("%w: %s %s at %s", errChanged, kind, id, created.Format(time.RFC3339)))
		}
	}
	for _, f := range r.filters() {
		ctx := context.Background()
		cs, err := r.api.containers(ctx, f)
		if err != nil {
			return out, err
		}
		for _, c := range cs {
			if c.Labels[ryukLabel] == "true" {
				continue
			}
			r.verbose("container %s %v created %d", c.ID, c.Names, c.Created)
			changed("container", c.ID, time.Unix(c.Created, 0))
			add(&out.containers, "container", c.ID)
		}
		ns, err := r.api.networks(ctx, f)
		if err != nil {
			return out, err
		}
		for _, n := range ns {
			r.verbose("network %s %s created %s", n.ID, n.Name, n.Created)
			changed("network", n.ID, n.Created)
			add(&out.networks, "network", n.ID)
		}
		vs, err := r.api.volumes(ctx, f)
		if err != nil {
			return out, err
		}
		for _, v := range vs {
			r.verbose("volume %s created %s", v.Name, v.CreatedAt)
			if t, err := time.Parse(time.RFC3339, v.CreatedAt); err == nil {
				changed("volume", v.Name, t)
			}
			add(&out.volumes, "volume", v.Name)
		}
		is, err := r.api.images(ctx, f)
		if err != nil {
			return out, err
		}
		for _, i := range is {
			r.verbose("image %s created %d", i.ID, i.Created)
			changed("image", i.ID, time.Unix(i.Created, 0))
			add(&out.images, "image", i.ID)
		}
	}
	return out, errors.Join(errs...)
}

func (r *reaper) verbose(format string, args ...any) {
	if r.cfg.verbose {
		r.log.Printf(format, args...)
	}
}

// prune removes the targets, containers first (a network or volume
// in use cannot go), each with retries; it reports what it could not remove.
func (r *reaper) prune(f targets) error {
	var errs []error
	steps := []struct {
		kind string
		ids  []string
		rm   func(context.Context, string) error
	}{
		{"container", f.containers, r.api.removeContainer},
		{"network", f.networks, r.api.removeNetwork},
		{"volume", f.volumes, r.api.removeVolume},
		{"image", f.images, r.api.removeImage},
	}
	for _, s := range steps {
		removed := 0
		for _, id := range s.ids {
			var err error
			for try := 1; try <= r.cfg.removeRetries; try++ {
				if err = s.rm(context.Background(), id); err == nil {
					break
				}
				if try < r.cfg.removeRetries {
					time.Sleep(time.Duration(try) * 100 * time.Millisecond)
				}
			}
			if err != nil {
				errs = append(errs, fmt.Errorf("remove %s %s: %w", s.kind, id, err))
				continue
			}
			removed++
		}
		if len(s.ids) > 0 {
			r.log.Printf("removed %d of %d %ss", removed, len(s.ids), s.kind)
		}
	}
	return errors.Join(errs...)
}

// dockerAPI is the part of the Docker engine API the reaper uses, over a
// unix socket. Paths carry no API version: the engine answers in its own.
type dockerAPI struct {
	hc      *http.Client
	timeout time.Duration
}

func newDockerAPI(socket string, timeout time.Duration) *dockerAPI {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		MaxIdleConns: 2,
	}
	return &dockerAPI{hc: &http.Client{Transport: tr}, timeout: timeout}
}

// apiError is an answer of the engine other than success.
type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return fmt.Sprintf("HTTP %d: %s", e.status, e.msg) }

func (d *dockerAPI) do(ctx context.Context, method, path string, q url.Values, out any) error {
	ctx, cancel := context.WithTimeout(ctx, d.timeout)
	defer cancel()
	u := "http://docker" + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, method, u, nil)
	if err != nil {
		return err
	}
	resp, err := d.hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		var m struct{ Message string }
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		if json.Unmarshal(body, &m) != nil || m.Message == "" {
			m.Message = strings.TrimSpace(string(body))
		}
		return &apiError{resp.StatusCode, m.Message}
	}
	if out == nil {
		_, err = io.Copy(io.Discard, resp.Body)
		return err
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

func (d *dockerAPI) ping(ctx context.Context) error {
	return d.do(ctx, http.MethodGet, "/_ping", nil, nil)
}

type containerInfo struct {
	ID      string `json:"Id"`
	Names   []string
	Created int64
	Labels  map[string]string
}

type networkInfo struct {
	ID      string `json:"Id"`
	Name    string
	Created time.Time
}

type volumeInfo struct {
	Name      string
	CreatedAt string
}

type imageInfo struct {
	ID      string `json:"Id"`
	Created int64
}

func filterQuery(f filterSet) url.Values {
	return url.Values{"filters": {string(f.json())}}
}

func (d *dockerAPI) containers(ctx context.Context, f filterSet) ([]containerInfo, error) {
	q := filterQuery(f)
	q.Set("all", "1")
	var out []containerInfo
	return out, d.do(ctx, http.MethodGet, "/containers/json", q, &out)
}

func (d *dockerAPI) networks(ctx context.Context, f filterSet) ([]networkInfo, error) {
	var out []networkInfo
	return out, d.do(ctx, http.MethodGet, "/networks", filterQuery(f), &out)
}

func (d *dockerAPI) volumes(ctx context.Context, f filterSet) ([]volumeInfo, error) {
	var out struct{ Volumes []volumeInfo }
	return out.Volumes, d.do(ctx, http.MethodGet, "/volumes", filterQuery(f), &out)
}

func (d *dockerAPI) images(ctx context.Context, f filterSet) ([]imageInfo, error) {
	var out []imageInfo
	return out, d.do(ctx, http.MethodGet, "/images/json", filterQuery(f), &out)
}

// gone treats "no such resource" as removed.
func gone(err error) error {
	var ae *apiError
	if errors.As(err, &ae) && ae.status == http.StatusNotFound {
		return nil
	}
	return err
}

func (d *dockerAPI) removeContainer(ctx context.Context, id string) error {
	q := url.Values{"force": {"1"}, "v": {"1"}}
	return gone(d.do(ctx, http.MethodDelete, "/containers/"+url.PathEscape(id), q, nil))
}

func (d *dockerAPI) removeNetwork(ctx context.Context, id string) error {
	return gone(d.do(ctx, http.MethodDelete, "/networks/"+url.PathEscape(id), nil, nil))
}

func (d *dockerAPI) removeVolume(ctx context.Context, name string) error {
	q := url.Values{"force": {"1"}}
	return gone(d.do(ctx, http.MethodDelete, "/volumes/"+url.PathEscape(name), q, nil))
}

func (d *dockerAPI) removeImage(ctx context.Context, id string) error {
	return gone(d.do(ctx, http.MethodDelete, "/images/"+url.PathEscape(id), nil, nil))
}
