package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// fakeEngine serves the list and remove calls of the Docker API the reaper
// makes, over a unix socket, with Docker's label filter semantics (every
// label filter must match).
type fakeEngine struct {
	mu      sync.Mutex
	res     map[string]fakeResource // kind/id → resource
	removed []string                // kind/id, in order
}

type fakeResource struct {
	labels  map[string]string
	created time.Time
}

func (e *fakeEngine) add(kind, id string, created time.Time, labels map[string]string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.res[kind+"/"+id] = fakeResource{labels, created}
}

func (e *fakeEngine) removedList() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.removed)
}

func matches(labels map[string]string, filters map[string]map[string]bool) bool {
	for f := range filters["label"] {
		k, v, hasValue := strings.Cut(f, "=")
		got, ok := labels[k]
		if !ok || (hasValue && got != v) {
			return false
		}
	}
	return true
}

func (e *fakeEngine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var filters map[string]map[string]bool
	if f := r.URL.Query().Get("filters"); f != "" {
		if err := json.Unmarshal([]byte(f), &filters); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
	}
	list := func(kind string, item func(id string, x fakeResource) any) []any {
		out := []any{}
		for key, x := range e.res {
			if k, id, _ := strings.Cut(key, "/"); k == kind && matches(x.labels, filters) {
				out = append(out, item(id, x))
			}
		}
		return out
	}
	var body any
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/_ping":
		body = "OK"
	case r.Method == http.MethodGet && r.URL.Path == "/containers/json":
		body = list("container", func(id string, x fakeResource) any {
			return map[string]any{"Id": id, "Names": []string{"/" + id}, "Created": x.created.Unix(), "Labels": x.labels}
		})
	case r.Method == http.MethodGet && r.URL.Path == "/networks":
		body = list("network", func(id string, x fakeResource) any {
			return map[string]any{"Id": id, "Name": id, "Created": x.created.Format(time.RFC3339Nano), "Labels": x.labels}
		})
	case r.Method == http.MethodGet && r.URL.Path == "/volumes":
		body = map[string]any{"Volumes": list("volume", func(id string, x fakeResource) any {
			return map[string]any{"Name": id, "CreatedAt": x.created.Format(time.RFC3339), "Labels": x.labels}
		})}
	case r.Method == http.MethodGet && r.URL.Path == "/images/json":
		body = list("image", func(id string, x fakeResource) any {
			return map[string]any{"Id": id, "Created": x.created.Unix(), "Labels": x.labels}
		})
	case r.Method == http.MethodDelete:
		kind, id, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
		kind = strings.TrimSuffix(kind, "s")
		if _, ok := e.res[kind+"/"+id]; !ok {
			http.Error(w, `{"message":"no such `+kind+`"}`, http.StatusNotFound)
			return
		}
		if kind == "container" && (r.URL.Query().Get("force") != "1" || r.URL.Query().Get("v") != "1") {
			http.Error(w, `{"message":"container removal without force and v"}`, http.StatusConflict)
			return
		}
		delete(e.res, kind+"/"+id)
		e.removed = append(e.removed, kind+"/"+id)
		w.WriteHeader(http.StatusNoContent)
		return
	default:
		http.Error(w, "unexpected "+r.Method+" "+r.URL.Path, http.StatusNotImplemented)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(body)
}

// startReaper runs a reaper against a fake engine and returns the engine,
// the reaper's address and a channel that gets run's result.
func startReaper(t *testing.T, ctx context.Context, cfg config) (*fakeEngine, string, <-chan error) {
	t.Helper()
	eng := &fakeEngine{res: map[string]fakeResource{}}
	sock := filepath.Join(t.TempDir(), "docker.sock")
	ul, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(eng)
	srv.Listener = ul
	srv.Start()
	t.Cleanup(srv.Close)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := newReaper(cfg, newDockerAPI(sock, 5*time.Second), ln, log.New(testWriter{t}, "reaper: ", 0))
	done := make(chan error, 1)
	go func() { done <- r.run(ctx) }()
	return eng, ln.Addr().String(), done
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func testConfig() config {
	return config{
		connectionTimeout:   5 * time.Second,
		reconnectionTimeout: 300 * time.Millisecond,
		requestTimeout:      5 * time.Second,
		shutdownTimeout:     5 * time.Second,
		removeRetries:       3,
		verbose:             true,
	}
}

// client connects and sends one filter line, as testcontainers does, and
// returns the connection after reading the reply.
func client(t *testing.T, addr, line, want string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(c, line+"\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	reply, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		t.Fatalf("reply to %q: %v", line, err)
	}
	if reply != want {
		t.Fatalf("reply to %q = %q, want %q", line, reply, want)
	}
	return c
}

func waitDone(t *testing.T, done <-chan error, within time.Duration) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(within):
		t.Fatalf("reaper still running after %s", within)
		return nil
	}
}

const session = "label=org.testcontainers=true&label=org.testcontainers.sessionId=s1&label=org.testcontainers.reap=true"

var sessionLabels = map[string]string{"org.testcontainers": "true", "org.testcontainers.sessionId": "s1", "org.testcontainers.reap": "true"}

// TestPruneAfterLastClient: what matches a client's filter is removed once
// the last client has left and the reconnection timeout has passed, and
// nothing else: not the reaper, not another session's resources.
func TestPruneAfterLastClient(t *testing.T) {
	eng, addr, done := startReaper(t, context.Background(), testConfig())
	old := time.Now().Add(-time.Minute)
	eng.add("container", "pg1", old, sessionLabels)
	eng.add("container", "reaper1", old, map[string]string{"org.testcontainers.sessionId": "s1", "org.testcontainers": "true", "org.testcontainers.reap": "true", ryukLabel: "true"})
	eng.add("container", "other", old, map[string]string{"org.testcontainers": "true", "org.testcontainers.sessionId": "s2", "org.testcontainers.reap": "true"})
	eng.add("container", "unlabelled", old, nil)
	eng.add("network", "net1", old, sessionLabels)
	eng.add("volume", "vol1", old, sessionLabels)
	eng.add("image", "img1", old, sessionLabels)

	c1 := client(t, addr, session, "ACK\n")
	c2 := client(t, addr, session, "ACK\n") // a second test binary of the same session
	_ = c1.Close()
	time.Sleep(3 * testConfig().reconnectionTimeout)
	if got := eng.removedList(); len(got) > 0 {
		t.Fatalf("removed %v while a client is still connected", got)
	}
	_ = c2.Close()
	if err := waitDone(t, done, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	want := []string{"container/pg1", "network/net1", "volume/vol1", "image/img1"}
	if got := eng.removedList(); !slices.Equal(got, want) {
		t.Fatalf("removed %v, want %v", got, want)
	}
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Fatal("reaper still accepts connections after pruning")
	}
}

// TestNoClient: without any client the reaper exits after the connection
// timeout and removes nothing.
func TestNoClient(t *testing.T) {
	cfg := testConfig()
	cfg.connectionTimeout = 200 * time.Millisecond
	eng, _, done := startReaper(t, context.Background(), cfg)
	eng.add("container", "pg1", time.Now().Add(-time.Minute), sessionLabels)
	if err := waitDone(t, done, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := eng.removedList(); len(got) > 0 {
		t.Fatalf("removed %v without any filter", got)
	}
}

// TestRefusesFilterWithoutLabel: a line without a label filter would match
// everything; it gets ERR and adds nothing.
func TestRefusesFilterWithoutLabel(t *testing.T) {
	eng, addr, done := startReaper(t, context.Background(), testConfig())
	eng.add("container", "pg1", time.Now().Add(-time.Minute), sessionLabels)
	c := client(t, addr, "name=pg1", "ERR\n")
	_ = c.Close()
	if err := waitDone(t, done, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := eng.removedList(); len(got) > 0 {
		t.Fatalf("removed %v", got)
	}
}

// TestRecentResourcePostponesPrune: a matching container created just now
// (another test binary is setting it up) postpones the prune by one period.
func TestRecentResourcePostponesPrune(t *testing.T) {
	cfg := testConfig()
	cfg.reconnectionTimeout = 200 * time.Millisecond
	eng, addr, done := startReaper(t, context.Background(), cfg)
	eng.add("container", "new", time.Now().Add(2*time.Second), sessionLabels) // "created" in the future: always recent
	c := client(t, addr, session, "ACK\n")
	_ = c.Close()
	time.Sleep(4 * cfg.reconnectionTimeout)
	if got := eng.removedList(); len(got) > 0 {
		t.Fatalf("removed %v created after the prune check began", got)
	}
	select {
	case err := <-done:
		t.Fatalf("reaper returned (%v) while a matching container is new", err)
	default:
	}
	eng.add("container", "new", time.Now().Add(-time.Minute), sessionLabels)
	if err := waitDone(t, done, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := eng.removedList(); !slices.Equal(got, []string{"container/new"}) {
		t.Fatalf("removed %v, want container/new", got)
	}
}

// TestSignal: a signal with no client connected prunes at once.
func TestSignal(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg := testConfig()
	cfg.reconnectionTimeout = time.Minute
	eng, addr, done := startReaper(t, ctx, cfg)
	eng.add("container", "pg1", time.Now().Add(-time.Minute), sessionLabels)
	c := client(t, addr, session, "ACK\n")
	_ = c.Close()
	time.Sleep(100 * time.Millisecond)
	cancel()
	if err := waitDone(t, done, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := eng.removedList(); !slices.Equal(got, []string{"container/pg1"}) {
		t.Fatalf("removed %v, want container/pg1", got)
	}
}

func TestParseFilters(t *testing.T) {
	f, err := parseFilters("label=b=2&label=a=1")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(f.json()), `{"label":{"a=1":true,"b=2":true}}`; got != want {
		t.Fatalf("json = %s, want %s", got, want)
	}
	for _, bad := range []string{"", "&", "name=x", "label=", "%zz"} {
		if _, err := parseFilters(bad); err == nil {
			t.Errorf("parseFilters(%q) accepted", bad)
		}
	}
}

func TestLoadConfig(t *testing.T) {
	env := map[string]string{"RYUK_PORT": "9090", "RYUK_RECONNECTION_TIMEOUT": "2s", "RYUK_VERBOSE": "true"}
	cfg, err := loadConfig(func(k string) string { return env[k] })
	if err != nil {
		t.Fatal(err)
	}
	if cfg.port != 9090 || cfg.reconnectionTimeout != 2*time.Second || !cfg.verbose || cfg.connectionTimeout != time.Minute {
		t.Fatalf("config = %+v", cfg)
	}
	for k, v := range map[string]string{"RYUK_PORT": "0", "RYUK_CONNECTION_TIMEOUT": "soon", "RYUK_VERBOSE": "maybe"} {
		if _, err := loadConfig(func(n string) string {
			if n == k {
				return v
			}
			return ""
		}); err == nil {
			t.Errorf("%s=%s accepted", k, v)
		}
	}
	if p, err := socketPath(func(string) string { return "unix:///tmp/x.sock" }); err != nil || p != "/tmp/x.sock" {
		t.Errorf("socketPath = %q, %v", p, err)
	}
	if _, err := socketPath(func(string) string { return "tcp://127.0.0.1:2375" }); err == nil {
		t.Error("tcp DOCKER_HOST accepted")
	}
}
