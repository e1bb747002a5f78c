package doccheck

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// ModuleRoot returns the directory of the go.mod that governs dir, and the
// module's path.
func ModuleRoot(dir string) (root, modulePath string, err error) {
	dir, err = filepath.Abs(dir)
	if err != nil {
		return "", "", err
	}
	for {
		data, err := os.ReadFile(filepath.Join(dir, "go.mod"))
		if err == nil {
			for line := range strings.Lines(string(data)) {
				if f := strings.Fields(line); len(f) == 2 && f[0] == "module" {
					return dir, strings.Trim(f[1], `"`), nil
				}
			}
			return "", "", fmt.Errorf("%s: no module line", filepath.Join(dir, "go.mod"))
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return "", "", err
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

// Docs returns the documents whose Go blocks are checked: README.md and every
// *.md file under docs/, as paths relative to root, sorted.
func Docs(root string) ([]string, error) {
	docs := []string{"README.md"}
	if _, err := os.Stat(filepath.Join(root, "README.md")); err != nil {
		return nil, err
	}
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) && p == filepath.Join(root, "docs") {
				return fs.SkipAll
			}
			return err
		}
		if !d.IsDir() && strings.EqualFold(filepath.Ext(p), ".md") {
			rel, err := filepath.Rel(root, p)
			if err != nil {
				return err
			}
			docs = append(docs, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	slices.Sort(docs[1:])
	return docs, nil
}

// ModuleImports maps the package name of every importable package of the
// module at root to its import path: packages outside internal/, testdata and
// nested modules, other than main. The packages of a nested module that
// root's go.work uses (observe/promobserve, a module of its own) are
// included, with the nested module's path: in workspace mode a block
// imports them as a reader's program does. A name that two packages share is
// left out.
func ModuleImports(root, modulePath string) (map[string]string, error) {
	out := map[string]string{}
	dup := map[string]bool{}
	workspace, err := workspaceModules(root)
	if err != nil {
		return nil, err
	}
	// modules maps the directory of every module walked to its path.
	modules := map[string]string{root: modulePath}
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		name := d.Name()
		if p != root {
			if name == "testdata" || name == "internal" || strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") {
				return fs.SkipDir
			}
			if _, err := os.Stat(filepath.Join(p, "go.mod")); err == nil {
				if !workspace[p] {
					return fs.SkipDir // a nested module outside the workspace
				}
				mp, err := goModPath(filepath.Join(p, "go.mod"))
				if err != nil {
					return err
				}
				modules[p] = mp
			}
		}
		pkg, err := packageName(p)
		if err != nil || pkg == "" || pkg == "main" {
			return err
		}
		// The import path: the path of the nearest module above p, and p's
		// directory below it.
		mdir := p
		for modules[mdir] == "" {
			mdir = filepath.Dir(mdir)
		}
		rel, err := filepath.Rel(mdir, p)
		if err != nil {
			return err
		}
		ip := modules[mdir]
		if rel != "." {
			ip += "/" + filepath.ToSlash(rel)
		}
		if _, ok := out[pkg]; ok {
			dup[pkg] = true
		}
		out[pkg] = ip
		return nil
	})
	for name := range dup {
		delete(out, name)
	}
	return out, err
}

// workspaceModules returns the directories of the modules root/go.work uses
// (none without a go.work).
func workspaceModules(root string) (map[string]bool, error) {
	data, err := os.ReadFile(filepath.Join(root, "go.work"))
	if errors.Is(err, fs.ErrNotExist) {
		return map[string]bool{}, nil
	}
	if err != nil {
		return nil, err
	}
	dirs := map[string]bool{}
	inUse := false
	for line := range strings.Lines(string(data)) {
		line, _, _ = strings.Cut(line, "//")
		f := strings.Fields(line)
		switch {
		case len(f) == 0:
		case inUse && f[0] == ")":
			inUse = false
		case inUse:
			dirs[filepath.Join(root, strings.Trim(f[0], `"`))] = true
		case f[0] == "use" && len(f) == 2 && f[1] == "(":
			inUse = true
		case f[0] == "use" && len(f) == 2:
			dirs[filepath.Join(root, strings.Trim(f[1], `"`))] = true
		}
	}
	return dirs, nil
}

// goModPath returns the module path of a go.mod file.
func goModPath(file string) (string, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	for line := range strings.Lines(string(data)) {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`), nil
		}
	}
	return "", fmt.Errorf("%s: no module line", file)
}

// packageName returns the package clause of the first non-test Go file of dir
// ("" if it has none).
func packageName(dir string) (string, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return "", err
	}
	for _, e := range entries {
		n := e.Name()
		if e.IsDir() || !strings.HasSuffix(n, ".go") || strings.HasSuffix(n, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), filepath.Join(dir, n), nil, parser.PackageClauseOnly)
		if err != nil {
			return "", err
		}
		return f.Name.Name, nil
	}
	return "", nil
}

// Compile writes every snippet as a package of its own under dir (a new
// directory inside the module at root), runs go vet on them, and lists every
// compile error of the ones vet refused with `go build -gcflags=-e`. It
// returns the go command's messages for each failed snippet, by index. An
// error means the go command failed in a way no snippet explains. The go
// command runs with the process's environment (GOFLAGS included).
func Compile(ctx context.Context, goBin, root, modulePath, dir string, snippets []*Snippet) (map[int]string, error) {
	rel, err := filepath.Rel(root, dir)
	if err != nil || strings.HasPrefix(rel, "..") {
		return nil, fmt.Errorf("%s is not inside the module at %s", dir, root)
	}
	byPath := map[string]int{}
	var dirs []string
	for i, s := range snippets {
		name := fmt.Sprintf("s%03d_%s_l%d", i, sanitize(s.Block.Doc), s.Block.FenceLine)
		pdir := filepath.Join(dir, name)
		if err := os.MkdirAll(pdir, 0o755); err != nil {
			return nil, err
		}
		for fn, src := range s.Files {
			if err := os.WriteFile(filepath.Join(pdir, fn), src, 0o644); err != nil {
				return nil, err
			}
		}
		byPath[modulePath+"/"+filepath.ToSlash(filepath.Join(rel, name))] = i
		dirs = append(dirs, "./"+filepath.ToSlash(filepath.Join(rel, name)))
	}
	if len(dirs) == 0 {
		return map[int]string{}, nil
	}
	// run runs the go command on the packages and returns the messages of
	// each failed one.
	run := func(args ...string) (map[int]string, error) {
		cmd := exec.CommandContext(ctx, goBin, args...)
		cmd.Dir = root
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		runErr := cmd.Run()
		if runErr == nil {
			return nil, nil
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("go %s: %w", args[0], ctx.Err())
		}
		per, rest := splitByPackage(out.String(), byPath)
		rest = attributeByLine(rest, root, snippets, per)
		if len(per) == 0 || strings.TrimSpace(rest) != "" {
			return per, fmt.Errorf("go %s: %v\n%s", args[0], runErr, out.String())
		}
		return per, nil
	}
	// go vet type-checks and runs the analyzers, but stops at a package's
	// first type error; go build -gcflags=-e then lists all of them for the
	// packages vet refused (usually none, and building them all costs more).
	failed, err := run(append([]string{"vet"}, dirs...)...)
	if err != nil || len(failed) == 0 {
		return failed, err
	}
	var idx []int
	for i := range failed {
		idx = append(idx, i)
	}
	slices.Sort(idx)
	// Main packages are built with -o into dir, never into the module root;
	// -o with no main package is an error, so they are built apart.
	var mains, others []string
	for _, i := range idx {
		if snippets[i].Package == "main" {
			mains = append(mains, dirs[i])
		} else {
			others = append(others, dirs[i])
		}
	}
	var builds [][]string
	if len(others) > 0 {
		builds = append(builds, append([]string{"build", "-gcflags=-e"}, others...))
	}
	if len(mains) > 0 {
		out := filepath.Join(dir, "bin") + string(filepath.Separator)
		builds = append(builds, append([]string{"build", "-gcflags=-e", "-o", out}, mains...))
	}
	for _, args := range builds {
		built, err := run(args...)
		for i, msg := range built {
			failed[i] = msg // all compile errors, instead of vet's first one
		}
		if err != nil {
			return failed, err
		}
	}
	return failed, nil
}

var nonWord = regexp.MustCompile(`[^a-z0-9]+`)

func sanitize(s string) string {
	return strings.Trim(nonWord.ReplaceAllString(strings.ToLower(s), "_"), "_")
}

// splitByPackage sorts the go command's output into the sections that follow
// "# import/path" headers of snippet packages, and the rest.
func splitByPackage(out string, byPath map[string]int) (per map[int]string, rest string) {
	per = map[int]string{}
	cur := -1
	var restB strings.Builder
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if h, ok := strings.CutPrefix(line, "# "); ok {
			// go vet names a main package "# [path]" too.
			h = strings.TrimSuffix(strings.TrimPrefix(strings.TrimSpace(h), "["), "]")
			if i, ok := byPath[h]; ok {
				cur = i
				continue
			}
			cur = -1
		}
		if cur >= 0 {
			// "./README.md:12:2: ..." → "README.md:12:2: ..."
			line = strings.TrimPrefix(line, "./")
			if r, ok := strings.CutPrefix(line, "vet: ./"); ok {
				line = "vet: " + r
			}
			per[cur] += line + "\n"
		} else {
			restB.WriteString(line + "\n")
		}
	}
	return per, restB.String()
}

var docPos = regexp.MustCompile(`^(?:vet: )?(\S+?\.md):(\d+)[:\s]`)

// attributeByLine moves the lines of out that name a document line inside a
// snippet's block (load errors come without a package header) to that
// snippet's messages, and returns the other lines.
func attributeByLine(out, root string, snippets []*Snippet, per map[int]string) string {
	var rest strings.Builder
	for line := range strings.Lines(out) {
		i := -1
		if m := docPos.FindStringSubmatch(line); m != nil {
			doc := m[1]
			if filepath.IsAbs(doc) {
				if r, err := filepath.Rel(root, doc); err == nil {
					doc = r
				}
			}
			doc = filepath.ToSlash(filepath.Clean(doc))
			n, _ := strconv.Atoi(m[2])
			for k, s := range snippets {
				b := s.Block
				if b.Doc == doc && n >= b.FenceLine && n <= b.Line+strings.Count(b.Text, "\n") {
					i = k
					break
				}
			}
		}
		if i >= 0 {
			per[i] += line
		} else {
			rest.WriteString(line)
		}
	}
	return rest.String()
}
