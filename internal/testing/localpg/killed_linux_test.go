package localpg

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestKilledParent SIGKILLs a process that started a cluster: the postmaster
// dies with it (parent-death signal), and the next sweep removes the
// directory it left behind.
func TestKilledParent(t *testing.T) {
	t.Parallel()
	tmp := privateTempDir(t)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1", "TMPDIR="+tmp)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatalf("helper did not start a cluster: %v", err)
	}
	dataDir := strings.TrimSpace(line)
	pidFile, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatal(err)
	}
	postmaster, err := strconv.Atoi(strings.SplitN(string(pidFile), "\n", 2)[0])
	if err != nil {
		t.Fatalf("postmaster.pid: %v", err)
	}

	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	// The postmaster is no child of ours, so there is nothing to wait on:
	// poll until it is gone (an immediate shutdown takes milliseconds).
	deadline := time.Now().Add(30 * time.Second)
	for !exited(postmaster) {
		if time.Now().After(deadline) {
			_ = syscall.Kill(postmaster, syscall.SIGQUIT)
			t.Fatalf("postmaster %d still running 30s after its parent was killed", postmaster)
		}
		time.Sleep(10 * time.Millisecond)
	}

	clusterDir := filepath.Dir(dataDir)
	if _, err := os.Stat(clusterDir); err != nil {
		t.Fatalf("the killed helper's directory should still be there before the sweep: %v", err)
	}
	sweepStale(tmp)
	if _, err := os.Stat(clusterDir); !os.IsNotExist(err) {
		t.Fatalf("%s not swept (stat: %v)", clusterDir, err)
	}
}

// exited reports whether pid is gone or a zombie (its new parent may be slow
// to reap it, or not reap at all in a container without an init).
func exited(pid int) bool {
	if errors.Is(syscall.Kill(pid, 0), syscall.ESRCH) {
		return true
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	// The state follows the command name, which is in parentheses.
	rest := string(stat[strings.LastIndexByte(string(stat), ')')+1:])
	return strings.HasPrefix(strings.TrimSpace(rest), "Z")
}
