package localpg

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(runHelper())
	}
	goleak.VerifyTestMain(m)
}

// privateTempDir returns a new directory that the unprivileged user a cluster
// runs as under root can enter, removed when t ends.
func privateTempDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "localpg-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// helperEnv makes the test binary act as a process that starts a cluster,
// prints its data directory and waits to be killed (see TestKilledParent).
const helperEnv = "LOCALPG_TEST_HELPER"

func runHelper() int {
	c, err := Start(context.Background(), Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println(c.DataDir())
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // killed before any input
	_ = c.Stop()
	return 0
}
