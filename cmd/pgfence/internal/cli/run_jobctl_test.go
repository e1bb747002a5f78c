//go:build linux

package cli

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
)

// TestRunJobControlIgnoredTSTP: Ctrl-Z stops a command that ignores SIGTSTP
// (pgfence follows the SIGTSTP with a SIGSTOP, which cannot be ignored), and
// once the lease went to another holder, neither fg (SIGCONT) nor kill %1
// (SIGTERM, then SIGCONT) lets the stopped command run again: it is killed
// as it is. Before, such a command kept running, and writing, while pgfence
// was stopped and its lease expired and went to another holder; a stopped
// one ran again on the SIGCONT (continued, or sent SIGTERM with a SIGCONT)
// before the kill.
func TestRunJobControlIgnoredTSTP(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name  string
		sigs  []syscall.Signal
		codes []int
	}{
		{"fg", []syscall.Signal{syscall.SIGCONT}, []int{ExitLeaseLost}},
		// Whichever of the two pgfence reads first, the lease is lost (76),
		// or the SIGTERM is what it reports (143).
		{"kill", []syscall.Signal{syscall.SIGTERM, syscall.SIGCONT}, []int{ExitLeaseLost, 128 + int(syscall.SIGTERM)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dsn := pgtest.DSN(t)
			marker := newMarker()
			out := filepath.Join(t.TempDir(), "writes")
			p := startPgfence(t, testEnv(dsn), marker, "run", "--lock", "jobctl-tstp", "--ttl", "4s",
				"--", "sh", "-c", `trap "" TSTP TERM; : > "$0"; echo ready; while :; do echo x >> "$0"; sleep 0.05; done; : `+marker, out)
			waitLine(t, p, p.errs, "started sh (pid ", 30*time.Second)
			waitLine(t, p, p.out, "ready", 30*time.Second)
			if err := p.cmd.Process.Signal(syscall.SIGTSTP); err != nil {
				t.Fatal(err)
			}
			// pgfence stops itself after it has sent the group its signals.
			// (The command's state is not what is checked: a shell stopped
			// while it forks its sleep shows D, waiting for the stopped
			// child.) What it writes from here on is at most the one line
			// under way.
			waitState(t, "T", p.cmd.Process.Pid)
			stopped := fileSize(t, out)

			// pgfence is stopped: its lease is not renewed, expires, and
			// another holder is granted it (this Acquire waits for that).
			r := run(t, dsn, "acquire", "--lock", "jobctl-tstp", "--ttl", "1m", "--holder", "other", "--json")
			var other struct {
				Token int64 `json:"token"`
			}
			if r.code != 0 || json.Unmarshal([]byte(r.stdout), &other) != nil || other.Token != 2 {
				t.Fatalf("another holder's acquire: %+v; want token 2", r)
			}
			before := fileSize(t, out)
			if before-stopped > 2 {
				t.Errorf("the command wrote %d bytes while pgfence was stopped (Ctrl-Z)", before-stopped)
			}
			for _, s := range c.sigs {
				if err := p.cmd.Process.Signal(s); err != nil {
					t.Fatal(err)
				}
			}
			if code := p.wait(t, 30*time.Second); !slices.Contains(c.codes, code) {
				t.Errorf("exit code %d, want one of %v", code, c.codes)
			}
			if after := fileSize(t, out); after != before {
				t.Errorf("the command wrote %d bytes after another holder was granted the lease", after-before)
			}
			if left := markerProcs(marker); len(left) > 0 {
				t.Errorf("processes left when pgfence exited: %q", left)
			}
		})
	}
}

func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Size()
}
