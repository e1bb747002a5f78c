//go:build unix

package cli

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDemoBinary builds the pgfence binary and runs `pgfence demo` as a user
// would, with no database: both runs and verdicts are printed, and no process
// or temporary directory is left behind.
func TestDemoBinary(t *testing.T) {
	t.Parallel()
	bin := filepath.Join(t.TempDir(), "pgfence")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/pgfence/pgfence/cmd/pgfence").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	// A private TMPDIR shows what the demo leaves behind. It must be
	// traversable by the unprivileged user PostgreSQL runs as under root.
	tmp, err := os.MkdirTemp("", "pgfence-demo-test-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(tmp)
	if err := os.Chmod(tmp, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "demo")
	env := []string{"TMPDIR=" + tmp}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") && !strings.HasPrefix(kv, "TMPDIR=") {
			env = append(env, kv)
		}
	}
	cmd.Env = env
	start := time.Now()
	out, err := cmd.CombinedOutput()
	took := time.Since(start)
	t.Logf("pgfence demo took %s:\n%s", took.Round(time.Millisecond), out)
	if err != nil {
		t.Fatalf("demo: %v", err)
	}
	s := string(out)
	for _, want := range []string{
		"Run 1", "Run 2", "PAUSED with SIGSTOP", "RESUMED with SIGCONT",
		"final balance 150 (right answer 160): WRONG",
		"write REJECTED by the database: stale token 1",
		"final balance 160 (right answer 160): CORRECT",
		"Stopped the throwaway PostgreSQL",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
	if took > 60*time.Second {
		t.Errorf("demo took %s, want well under 30s", took)
	}
	entries, err := os.ReadDir(tmp)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		t.Errorf("demo left %s in TMPDIR", e.Name())
	}
	// No process started by the demo survives: neither a worker (same binary)
	// nor a postgres whose data directory was under tmp.
	procs, _ := filepath.Glob("/proc/[0-9]*")
	for _, p := range procs {
		exe, _ := os.Readlink(p + "/exe")
		cmdline, _ := os.ReadFile(p + "/cmdline")
		if exe == bin || strings.Contains(string(cmdline), tmp) {
			pid, _ := strconv.Atoi(filepath.Base(p))
			if syscall.Kill(pid, 0) == nil {
				t.Errorf("process %d (%s) left running: %q", pid, exe, cmdline)
			}
		}
	}
}
