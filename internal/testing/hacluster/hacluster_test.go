package hacluster

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The watchdog kills every process carrying the token and removes the
// directory when the test process's end of the pipe closes without "done".
func TestReaperSweepsWhenThePipeCloses(t *testing.T) {
	dir, err := os.MkdirTemp("", "pgfha-reapertest-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	token := filepath.Base(dir)
	victim := startTokenProcess(t, token)
	r, err := startReaper(token, dir)
	if err != nil {
		t.Fatal(err)
	}
	r.finish(false)
	waitGone(t, victim)
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("directory %s still there after the sweep (%v)", dir, err)
	}
	if left := processesWith(token); len(left) > 0 {
		t.Errorf("processes left: %+v", left)
	}
}

// After "done" the watchdog leaves everything alone.
func TestReaperDisarmed(t *testing.T) {
	dir, err := os.MkdirTemp("", "pgfha-reapertest-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	token := filepath.Base(dir)
	victim := startTokenProcess(t, token)
	r, err := startReaper(token, dir)
	if err != nil {
		t.Fatal(err)
	}
	r.finish(true)
	if victim.ProcessState != nil || !alive(victim.Process.Pid) {
		t.Fatal("a disarmed watchdog killed a process")
	}
	if _, err := os.Stat(dir); err != nil {
		t.Errorf("a disarmed watchdog removed the directory: %v", err)
	}
	_ = victim.Process.Kill()
	_ = victim.Wait()
}

// startTokenProcess starts a shell whose command line carries token.
func startTokenProcess(t *testing.T, token string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command("/bin/sh", "-c", "while :; do sleep 1; done", token)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	deadline := time.Now().Add(5 * time.Second)
	for len(processesWith(token)) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the token process does not show in /proc")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cmd
}

func waitGone(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatalf("pid %d survived the sweep", cmd.Process.Pid)
	}
}

func TestFreePortsAreDistinctAndFree(t *testing.T) {
	ports, err := freePorts(8)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	lo := ephemeralLow()
	for _, p := range ports {
		if seen[p] {
			t.Fatalf("port %d twice in %v", p, ports)
		}
		seen[p] = true
		if lo > 12000 && p >= lo {
			t.Errorf("port %d is in the ephemeral range starting at %d", p, lo)
		}
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			t.Errorf("port %d not free: %v", p, err)
			continue
		}
		l.Close()
	}
}

func TestPostmasterPIDVerifiesTheCommandLine(t *testing.T) {
	dir := t.TempDir()
	// A pid file naming this test process: alive, but not a postmaster of dir.
	if err := os.WriteFile(filepath.Join(dir, "postmaster.pid"), []byte(fmt.Sprintf("%d\n%s\n", os.Getpid(), dir)), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := postmasterPID(dir); err == nil || !strings.Contains(err.Error(), "not its postmaster") {
		t.Fatalf("postmasterPID accepted a process that is not the postmaster: %v", err)
	}
	if _, err := postmasterPID(filepath.Join(dir, "missing")); err == nil {
		t.Fatal("postmasterPID without a pid file: no error")
	}
}

func TestDSNForms(t *testing.T) {
	c := &Cluster{nodes: []*Node{{Name: "n1", Port: 1001}, {Name: "n2", Port: 1002}, {Name: "n3", Port: 1003}}}
	if got, want := c.DSN("app"), "postgres://postgres@127.0.0.1:1001,127.0.0.1:1002,127.0.0.1:1003/app?connect_timeout=2&sslmode=disable&target_session_attrs=read-write"; got != want {
		t.Errorf("DSN = %s, want %s", got, want)
	}
	if got, want := c.KeywordDSN("app"), "host=127.0.0.1,127.0.0.1,127.0.0.1 port=1001,1002,1003 dbname=app user=postgres target_session_attrs=read-write connect_timeout=2 sslmode=disable"; got != want {
		t.Errorf("KeywordDSN = %s, want %s", got, want)
	}
}

// When something is missing, the error names it and says what to install.
func TestMissingSaysWhatToInstall(t *testing.T) {
	if missingError(nil) != nil {
		t.Error("nothing missing, yet an error")
	}
	err := missingError([]string{"etcd (Debian package etcd-server)"})
	if err == nil || !strings.Contains(err.Error(), "etcd-server") || !strings.Contains(err.Error(), "apt-get install patroni etcd-server") ||
		!strings.Contains(err.Error(), "make test-deps") {
		t.Errorf("error does not say what to install: %v", err)
	}
}
