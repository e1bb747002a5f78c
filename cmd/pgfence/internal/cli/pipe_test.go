//go:build linux

package cli

import (
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestAcquireClosedPipe: the binary's acquire whose stdout is a pipe with no
// reader (pgfence acquire ... | true) releases the lease and exits 1. The
// write killed the process with SIGPIPE before the error could be seen: the
// lease stayed held for its TTL, and nobody had its key. release on such a
// pipe exits 1 too (the release itself is done).
func TestAcquireClosedPipe(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	bin := pgfenceBin(t)
	runOnClosedPipe := func(args ...string) (int, string) {
		t.Helper()
		r, w, err := os.Pipe()
		if err != nil {
			t.Fatal(err)
		}
		r.Close() // nobody reads: a write gets EPIPE, or SIGPIPE kills the writer
		var stderr strings.Builder
		cmd := exec.Command(bin, args...)
		cmd.Env = testEnv(dsn)
		cmd.Stdout, cmd.Stderr = w, &stderr
		err = cmd.Run()
		w.Close()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatalf("%v: %v", args, err)
		}
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return -int(ws.Signal()), stderr.String()
		}
		return cmd.ProcessState.ExitCode(), stderr.String()
	}
	code, stderr := runOnClosedPipe("acquire", "--lock", "piped", "--ttl", "1h")
	if code != ExitError || !strings.Contains(stderr, "released") {
		t.Fatalf("acquire on a closed pipe: exit %d (negative: killed by that signal), stderr %q; want %d, the lease released", code, stderr, ExitError)
	}
	if v := lockState(t, dsn, "piped"); v.State != "free" || v.Token != 1 {
		t.Fatalf("after acquire on a closed pipe: %+v; want free, token 1", v)
	}
	r := run(t, dsn, "acquire", "--lock", "piped", "--ttl", "1h", "--json")
	var got struct {
		Token int64  `json:"token"`
		Key   string `json:"key"`
	}
	if r.code != 0 || json.Unmarshal([]byte(r.stdout), &got) != nil {
		t.Fatalf("acquire: %+v", r)
	}
	code, stderr = runOnClosedPipe("release", "--lock", "piped", "--token", strconv.FormatInt(got.Token, 10), "--key", got.Key)
	if v := lockState(t, dsn, "piped"); code != ExitError || v.State != "free" {
		t.Fatalf("release on a closed pipe: exit %d, stderr %q, lock %+v; want %d and the lock free", code, stderr, v, ExitError)
	}
}

// TestRunClosedStderr: the binary's run whose stderr is a pipe with no
// reader, and a command that exits leaving a process behind. The
// supervisor, which shares pgfence's stderr, says so there: SIGPIPE killed
// it, so pgfence could not tell that the tree was gone, left the lease held
// until its TTL and exited 1. The write must get EPIPE instead: the
// supervisor stops the leftover process, and pgfence releases the lease and
// exits with the command's status.
func TestRunClosedStderr(t *testing.T) {
	t.Parallel()
	dsn := pgtest.DSN(t)
	marker := newMarker()
	t.Cleanup(func() { killMarker(marker) })
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	r.Close() // nobody reads: a write gets EPIPE, or SIGPIPE kills the writer
	cmd := exec.Command(pgfenceBin(t), "run", "--lock", "closed-stderr", "--ttl", "1h", "--grace", "10s",
		"--", "sh", "-c", "sleep "+marker+" & exit 0")
	cmd.Env = testEnv(dsn)
	cmd.Stderr = w
	err = cmd.Run()
	w.Close()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatal(err)
	}
	if code := cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("exit %d, want 0 (1: the supervisor died, the lease was left held)", code)
	}
	if left := markerProcs(marker); len(left) > 0 {
		t.Errorf("processes left when pgfence exited: %q", left)
	}
	if v := lockState(t, dsn, "closed-stderr"); v.State != "free" || v.Token != 1 {
		t.Errorf("lock after run: %+v; want free, token 1", v)
	}
}
