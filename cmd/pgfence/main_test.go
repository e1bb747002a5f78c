package main

import (
	"encoding/json"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const modulePath = "github.com/pgfence/pgfence/cmd/pgfence"

// TestVersionBinary builds pgfence as a user would from this checkout and
// checks that `--version` and `version` report the module and, when the
// checkout is a git repository, the commit it was built from.
func TestVersionBinary(t *testing.T) {
	t.Parallel()
	goBin := goCommand(t)

	// Build with the revision stamped when git can describe this checkout
	// (what `go build` does by default); GOFLAGS may say otherwise.
	head, gitErr := exec.Command("git", "rev-parse", "HEAD").Output()
	if gitErr == nil {
		gitErr = exec.Command("git", "status", "--porcelain").Run()
	}
	if gitErr == nil {
		// The go command stamps no revision in a linked worktree (`git
		// worktree add`), whose git directory is not the repository's.
		dir, err1 := exec.Command("git", "rev-parse", "--absolute-git-dir").Output()
		common, err2 := exec.Command("git", "rev-parse", "--path-format=absolute", "--git-common-dir").Output()
		switch {
		case err1 != nil || err2 != nil:
			gitErr = errors.Join(err1, err2)
		case strings.TrimSpace(string(dir)) != strings.TrimSpace(string(common)):
			gitErr = errors.New("a linked git worktree")
		}
	}
	vcs := "-buildvcs=false"
	if gitErr == nil {
		vcs = "-buildvcs=true"
	} else {
		t.Logf("not checking the revision: git cannot describe this checkout: %v", gitErr)
	}
	bin := filepath.Join(t.TempDir(), "pgfence")
	if out, err := exec.Command(goBin, "build", vcs, "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", vcs, err, out)
	}

	runBin := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(bin, args...).Output()
		if err != nil {
			t.Fatalf("pgfence %s: %v (want exit 0)", strings.Join(args, " "), err)
		}
		return string(out)
	}
	line := runBin("--version")
	details := runBin("version")
	var info struct {
		Module   string `json:"module"`
		Version  string `json:"version"`
		Revision string `json:"revision"`
		Modified bool   `json:"modified"`
	}
	if err := json.Unmarshal([]byte(runBin("version", "--json")), &info); err != nil {
		t.Fatalf("version --json: %v", err)
	}
	t.Logf("--version: %s", line)

	if strings.Count(line, "\n") != 1 || !strings.HasPrefix(line, "pgfence ") || !strings.Contains(line, modulePath) {
		t.Errorf("--version = %q, want one line with pgfence and %s", line, modulePath)
	}
	if !strings.HasPrefix(details, line) || !strings.Contains(details, "module:    "+modulePath+"\n") {
		t.Errorf("version does not start with the --version line and name the module:\n%s", details)
	}
	if info.Module != modulePath || info.Version == "" {
		t.Errorf("version --json: %+v", info)
	}
	if gitErr != nil {
		return
	}
	rev := strings.TrimSpace(string(head))
	if info.Revision != rev {
		t.Errorf("revision %q, want HEAD %q", info.Revision, rev)
	}
	if !strings.Contains(line, "revision "+rev[:12]) || !strings.Contains(details, "revision:  "+rev) {
		t.Errorf("the revision %s is missing:\n%s%s", rev, line, details)
	}
	if dirty := strings.Contains(line, rev[:12]+"+dirty"); dirty != info.Modified {
		t.Errorf("line says dirty=%v, JSON says modified=%v", dirty, info.Modified)
	}
}
