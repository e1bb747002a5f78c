package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// heavyDeps are fragments of import paths that must never be linked into the
// pgfence binary: the container test harness and what it drags in. They
// belong to the tests only (internal/testing/pgserver).
var heavyDeps = []string{
	"testcontainers",
	"docker",
	"moby",
	"containerd",
	"opencontainers",
	"testify",
	"logrus",
	"gopsutil",
}

// goCommand returns the go command to run: the one on PATH (go test puts its
// own GOROOT/bin first), else $GOROOT/bin/go.
func goCommand(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	if root := os.Getenv("GOROOT"); root != "" {
		p := filepath.Join(root, "bin", "go")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	t.Fatal("the go command is needed to list the binary's dependencies: it is neither on PATH nor in $GOROOT/bin")
	return ""
}

// TestNoHeavyDependencies keeps `go install .../cmd/pgfence` lean: no package
// the binary imports, on any of the listed platforms, may come from the
// container test harness.
func TestNoHeavyDependencies(t *testing.T) {
	t.Parallel()
	goBin := goCommand(t)
	for _, goos := range []string{"linux", "darwin", "windows"} {
		t.Run(goos, func(t *testing.T) {
			cmd := exec.Command(goBin, "list", "-deps", ".")
			cmd.Env = append(os.Environ(), "GOOS="+goos, "GOARCH=amd64")
			out, err := cmd.Output()
			if err != nil {
				var stderr string
				if ee, ok := err.(*exec.ExitError); ok {
					stderr = string(ee.Stderr)
				}
				t.Fatalf("go list -deps: %v\n%s", err, stderr)
			}
			pkgs := strings.Fields(string(out))
			if len(pkgs) < 10 {
				t.Fatalf("go list -deps printed %d packages, expected the binary's dependency list:\n%s", len(pkgs), out)
			}
			var found []string
			for _, p := range pkgs {
				for _, bad := range heavyDeps {
					if strings.Contains(p, bad) {
						found = append(found, p)
						break
					}
				}
			}
			if len(found) > 0 {
				t.Errorf("GOOS=%s: the pgfence binary imports %d packages of the test harness (paths containing any of %q); "+
					"keep them out of cmd/pgfence (find the importer with: go list -deps -f '{{.ImportPath}}: {{.Imports}}' ./cmd/pgfence):\n  %s",
					goos, len(found), heavyDeps, strings.Join(found, "\n  "))
			}
			t.Logf("GOOS=%s: %d packages", goos, len(pkgs))
		})
	}
}
