// Package repo finds the pgfence repository from the tests, and builds the
// pgfence command (the module in cmd/pgfence) for tests of the library's
// module that run it as a user would.
package repo

import (
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
)

// Root returns the repository's directory (the pgfence module's root).
func Root() string {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		panic("repo: runtime.Caller failed")
	}
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", ".."))
}

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// Pgfence builds the pgfence command from cmd/pgfence once per test process
// and returns the binary's path. The binary is built into a fixed place
// under the temporary directory, one per user and checkout (built next to it and renamed into place, so
// concurrent test processes never see half a file), so runs do not pile up
// copies. The build runs in cmd/pgfence, so it works with and without the
// repository's go.work (the module's replace directives find the library).
func Pgfence(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		// One directory per user and checkout: tests of another checkout
		// running at the same time build their own binary.
		root := Root()
		sum := sha256.Sum256([]byte(root))
		dir := filepath.Join(os.TempDir(), fmt.Sprintf("pgfence-test-bin-%d-%x", os.Getuid(), sum[:6]))
		if binErr = os.MkdirAll(dir, 0o700); binErr != nil {
			return
		}
		tmp := filepath.Join(dir, fmt.Sprintf("pgfence.%d.tmp", os.Getpid()))
		cmd := exec.Command("go", "build", "-o", tmp, ".")
		cmd.Dir = filepath.Join(root, "cmd", "pgfence")
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go build in cmd/pgfence: %v\n%s", err, out)
			return
		}
		binPath = filepath.Join(dir, "pgfence")
		binErr = os.Rename(tmp, binPath)
	})
	if binErr != nil {
		t.Fatalf("build pgfence: %v", binErr)
	}
	return binPath
}
