package layers

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/pgfence/pgfence/internal/testing/repo"
)

// modulePath is the root module's path.
const modulePath = "github.com/pgfence/pgfence"

// pkg is one package of `go list -deps -json`.
type pkg struct {
	ImportPath string
	Name       string
	Standard   bool
	DepOnly    bool
	Module     *struct{ Path string }
	Imports    []string // of its non-test files
}

func (p *pkg) module() string {
	if p.Module == nil {
		return ""
	}
	return p.Module.Path
}

func isTesting(path string) bool { return strings.HasPrefix(path, modulePath+"/internal/testing/") }

// isLibInternal: the library's own internal packages, the floor.
func isLibInternal(path string) bool {
	return strings.HasPrefix(path, modulePath+"/internal/") && !isTesting(path)
}

// isTestHelper: the public package of test helpers for users' tests. It
// may use the test harness and link what it needs (testcontainers-go), since
// only test binaries import it; no other public package may import it.
func isTestHelper(path string) bool { return path == modulePath+"/pgfencetest" }

// isPublic: a package of the root module outside internal/.
func isPublic(p *pkg) bool {
	return p.module() == modulePath && p.Name != "main" && !strings.HasPrefix(p.ImportPath, modulePath+"/internal/")
}

// allowedModule: the modules a public package may link besides the
// standard library and pgfence's own (gooseDeps: the modules of the packages
// goose's packages import).
func allowedModule(mod string, gooseDeps map[string]bool) bool {
	return mod == modulePath || strings.HasPrefix(mod, "github.com/jackc/") || strings.HasPrefix(mod, "golang.org/x/") ||
		mod == "github.com/pressly/goose/v3" || gooseDeps[mod]
}

// check returns the layering violations of the packages of graph that the
// listing named (not DepOnly), each with the chain of imports that leads to
// it.
func check(graph map[string]*pkg) []string {
	// The modules goose's packages bring along.
	gooseDeps := map[string]bool{}
	for _, p := range graph {
		if p.module() == "github.com/pressly/goose/v3" {
			walk(graph, p.ImportPath, func(q *pkg, _ []string) {
				if q.module() != "" {
					gooseDeps[q.module()] = true
				}
			})
		}
	}
	var out []string
	var roots []string
	for path, p := range graph {
		if !p.DepOnly {
			roots = append(roots, path)
		}
	}
	slices.Sort(roots)
	for _, r := range roots {
		root := graph[r]
		seenMod := map[string]bool{}
		walk(graph, r, func(q *pkg, chain []string) {
			if q.ImportPath == r {
				return
			}
			via := strings.Join(chain, " → ")
			switch {
			case isLibInternal(r) && isPublic(q):
				out = append(out, fmt.Sprintf("%s (library internal) imports the public package %s: %s", r, q.ImportPath, via))
			case isLibInternal(r) && isTesting(q.ImportPath):
				out = append(out, fmt.Sprintf("%s (library internal) imports the test harness %s: %s", r, q.ImportPath, via))
			case isPublic(root) && !isTestHelper(r) && isTestHelper(q.ImportPath):
				out = append(out, fmt.Sprintf("%s (public) imports the test helpers %s: %s", r, q.ImportPath, via))
			case isTestHelper(r):
				// Links the harness and testcontainers-go by design.
			case isPublic(root) && isTesting(q.ImportPath):
				out = append(out, fmt.Sprintf("%s (public) imports the test harness %s in a non-test file: %s", r, q.ImportPath, via))
			case isPublic(root) && !q.Standard && !allowedModule(q.module(), gooseDeps) && !seenMod[q.module()]:
				seenMod[q.module()] = true
				out = append(out, fmt.Sprintf("%s (public) links module %s (package %s), outside the standard library, pgx, goose and golang.org/x: %s",
					r, q.module(), q.ImportPath, via))
			}
		})
	}
	return out
}

// walk calls visit for every package reachable from start through non-test
// imports (start included), breadth first, with the chain of imports from
// start to it.
func walk(graph map[string]*pkg, start string, visit func(q *pkg, chain []string)) {
	parent := map[string]string{start: ""}
	queue := []string{start}
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		p := graph[cur]
		if p == nil {
			continue
		}
		var chain []string
		for c := cur; c != ""; c = parent[c] {
			chain = append(chain, c)
		}
		slices.Reverse(chain)
		visit(p, chain)
		for _, imp := range p.Imports {
			if _, ok := parent[imp]; !ok {
				parent[imp] = cur
				queue = append(queue, imp)
			}
		}
	}
}

// listDeps runs `go list -deps -json` on the root module's packages for goos,
// outside the workspace (the root module alone, as a user's build sees it).
func listDeps(t *testing.T, goos string) map[string]*pkg {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("the go command is needed to list the packages' dependencies: %v", err)
	}
	cmd := exec.Command(goBin, "list", "-deps", "-json=ImportPath,Name,Standard,DepOnly,Module,Imports", "./...")
	cmd.Dir = repo.Root()
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOOS="+goos, "GOARCH=amd64")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, stderr.String())
	}
	graph := map[string]*pkg{}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	for {
		var p pkg
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("go list -deps: %v", err)
		}
		graph[p.ImportPath] = &p
	}
	return graph
}

// TestLayers runs the checks of the package documentation on the root
// module, for the platforms the library builds on.
func TestLayers(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat(filepath.Join(repo.Root(), "go.mod")); err != nil {
		t.Fatal(err)
	}
	for _, goos := range []string{"linux", "darwin", "windows"} {
		t.Run(goos, func(t *testing.T) {
			graph := listDeps(t, goos)
			public, lib := 0, 0
			for _, p := range graph {
				switch {
				case p.DepOnly:
				case isPublic(p):
					public++
				case isLibInternal(p.ImportPath):
					lib++
				}
			}
			if public < 7 || lib < 6 {
				t.Fatalf("go list found %d public and %d library-internal packages, expected the root module's", public, lib)
			}
			for _, v := range check(graph) {
				t.Error(v)
			}
			t.Logf("GOOS=%s: %d public and %d library-internal packages, %d packages in all", goos, public, lib, len(graph))
		})
	}
}

// TestCheckCatchesBadImports: each kind of bad import, in a made-up graph,
// is reported with the chain that leads to it.
func TestCheckCatchesBadImports(t *testing.T) {
	t.Parallel()
	mod := func(path string) *struct{ Path string } { return &struct{ Path string }{path} }
	root := mod(modulePath)
	graph := map[string]*pkg{}
	add := func(path, name string, m *struct{ Path string }, depOnly bool, imports ...string) {
		graph[path] = &pkg{ImportPath: path, Name: name, Module: m, DepOnly: depOnly, Imports: imports}
	}
	add(modulePath+"/pglock", "pglock", root, false, modulePath+"/internal/pgerr", "github.com/jackc/pgx/v5")
	add(modulePath+"/internal/pgerr", "pgerr", root, false, modulePath+"/internal/testing/pgtest")
	add(modulePath+"/internal/testing/pgtest", "pgtest", root, false, modulePath+"/skiplocked")
	add(modulePath+"/skiplocked", "skiplocked", root, false, "github.com/spf13/cobra")
	add(modulePath+"/internal/holder", "holder", root, false, "fmt")
	add(modulePath+"/fencedwrite", "fencedwrite", root, false, "go.yaml.in/yaml/v3", "github.com/pressly/goose/v3")
	// The test helpers may use the harness and testcontainers; outbox may not import them.
	add(modulePath+"/pgfencetest", "pgfencetest", root, false, modulePath+"/internal/testing/pgserver", "github.com/testcontainers/testcontainers-go")
	add(modulePath+"/internal/testing/pgserver", "pgserver", root, false, "github.com/testcontainers/testcontainers-go")
	add("github.com/testcontainers/testcontainers-go", "testcontainers", mod("github.com/testcontainers/testcontainers-go"), true)
	add(modulePath+"/outbox", "outbox", root, false, modulePath+"/pgfencetest")
	add("github.com/jackc/pgx/v5", "pgx", mod("github.com/jackc/pgx/v5"), true)
	add("github.com/spf13/cobra", "cobra", mod("github.com/spf13/cobra"), true)
	add("go.yaml.in/yaml/v3", "yaml", mod("go.yaml.in/yaml/v3"), true)
	add("github.com/pressly/goose/v3", "goose", mod("github.com/pressly/goose/v3"), true, "github.com/sethvargo/go-retry")
	add("github.com/sethvargo/go-retry", "retry", mod("github.com/sethvargo/go-retry"), true)
	graph["fmt"] = &pkg{ImportPath: "fmt", Name: "fmt", Standard: true, DepOnly: true}

	got := strings.Join(check(graph), "\n")
	for _, want := range []string{
		// (a) the floor imports the harness, and through it a public package
		modulePath + "/internal/pgerr (library internal) imports the test harness " + modulePath + "/internal/testing/pgtest",
		modulePath + "/internal/pgerr (library internal) imports the public package " + modulePath + "/skiplocked: " +
			modulePath + "/internal/pgerr → " + modulePath + "/internal/testing/pgtest → " + modulePath + "/skiplocked",
		// (b) a public package imports the harness
		modulePath + "/pglock (public) imports the test harness " + modulePath + "/internal/testing/pgtest in a non-test file: " +
			modulePath + "/pglock → " + modulePath + "/internal/pgerr → " + modulePath + "/internal/testing/pgtest",
		// (c) a public package links a module outside the allowed set
		modulePath + "/skiplocked (public) links module github.com/spf13/cobra (package github.com/spf13/cobra)",
		modulePath + "/pglock (public) links module github.com/spf13/cobra",
		modulePath + "/fencedwrite (public) links module go.yaml.in/yaml/v3",
		// (d) a public package imports the test helpers
		modulePath + "/outbox (public) imports the test helpers " + modulePath + "/pgfencetest",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("check does not report %q; it reported:\n%s", want, got)
		}
	}
	for _, never := range []string{"internal/holder (", "fencedwrite (public) links module github.com/pressly", "go-retry", "jackc",
		"pgfencetest (public)"} {
		if strings.Contains(got, never) {
			t.Errorf("check reports %q, which is allowed:\n%s", never, got)
		}
	}
}
