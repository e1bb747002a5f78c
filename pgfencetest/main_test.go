package pgfencetest

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain stops the server the tests started, then checks for leaked
// goroutines. (A user's test binary need not: the server dies with it.)
func TestMain(m *testing.M) {
	code := m.Run()
	stopServer()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreAnyFunction("github.com/testcontainers/testcontainers-go.(*Reaper).connect.func1")); err != nil {
			os.Stderr.WriteString("goleak: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}

// ServerKind says how this process's server was obtained ("dsn",
// "testcontainers", "local-binaries"), for the tests.
func ServerKind() string {
	srvMu.Lock()
	defer srvMu.Unlock()
	if srv == nil {
		return ""
	}
	return string(srv.Kind)
}
