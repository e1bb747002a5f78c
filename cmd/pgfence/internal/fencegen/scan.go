package fencegen

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
)

// existingMigrations is what Plan learns from the migrations directory.
type existingMigrations struct {
	maxVersion   int64
	maxName      string
	addColumn    map[string]string // ADD COLUMN statement for the table -> file
	guard        string            // newest guard/unguard statement for the table
	guardPath    string
	guardOnFence bool // some guard statement for the table names the fence column
}

type genMigration struct {
	name, path string
	version    int64
	up         []string
}

// gooseVersion parses the version of a goose migration file name
// ("<digits>_<name>.sql" or ".go").
func gooseVersion(name string) (int64, bool) {
	i := strings.IndexByte(name, '_')
	if i <= 0 || !(strings.HasSuffix(name, ".sql") || strings.HasSuffix(name, ".go") && !strings.HasSuffix(name, "_test.go")) {
		return 0, false
	}
	if strings.Trim(name[:i], "0123456789") != "" {
		return 0, false
	}
	v, err := strconv.ParseInt(name[:i], 10, 64)
	return v, err == nil
}

func scanMigrations(dir string, p *plan) (*existingMigrations, error) {
	ex := &existingMigrations{addColumn: map[string]string{}}
	entries, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return ex, nil
	}
	if err != nil {
		return nil, fmt.Errorf("fencegen: %w", err)
	}
	base := p.fileBase()
	var gens []genMigration
	for _, e := range entries {
		name := e.Name()
		v, ok := gooseVersion(name)
		if !ok {
			continue
		}
		if v > ex.maxVersion {
			ex.maxVersion, ex.maxName = v, name
		}
		rest := name[strings.IndexByte(name, '_'):]
		if rest != columnSuffix+base+".sql" && rest != guardSuffix+base+".sql" {
			continue
		}
		path := filepath.Join(dir, name)
		data, err := os.ReadFile(path)
		if err != nil {
			return nil, fmt.Errorf("fencegen: %w", err)
		}
		if !isGenerated(data) {
			return nil, fmt.Errorf("%w: %s is named like a generated migration but does not start with %q; fencegen cannot tell what it does",
				ErrConflict, path, generatedPrefix)
		}
		gens = append(gens, genMigration{name: name, path: path, version: v, up: upStatements(data)})
	}
	sort.Slice(gens, func(i, j int) bool {
		if gens[i].version != gens[j].version {
			return gens[i].version < gens[j].version
		}
		return gens[i].name < gens[j].name
	})
	tbl := p.table.String()
	addPrefix := "ALTER TABLE " + tbl + " ADD COLUMN "
	// Files generated before v0.1.0 name the type regclass unqualified.
	guardPrefix := "SELECT pgfence.guard('" + tbl + "'::pg_catalog.regclass"
	oldGuardPrefix := "SELECT pgfence.guard('" + tbl + "'::regclass"
	unguard := unguardSQL(p.table)
	oldUnguard := strings.Replace(unguard, "::pg_catalog.regclass", "::regclass", 1)
	for _, g := range gens {
		for _, st := range g.up {
			switch {
			case strings.HasPrefix(st, addPrefix):
				if _, ok := ex.addColumn[st]; !ok {
					ex.addColumn[st] = g.path
				}
			case strings.HasPrefix(st, guardPrefix), strings.HasPrefix(st, oldGuardPrefix), st == unguard, st == oldUnguard:
				// Compared in the current form.
				ex.guard, ex.guardPath = strings.Replace(st, "'::regclass", "'::pg_catalog.regclass", 1), g.path
				if strings.Contains(st, "fence_column => '"+p.fence+"'") {
					ex.guardOnFence = true
				}
			}
		}
	}
	return ex, nil
}

func (ex *existingMigrations) checkVersion(name, dir string) error {
	v, _ := gooseVersion(name)
	if v <= ex.maxVersion {
		return fmt.Errorf("%w: %s: version %d is not newer than %s, the newest migration in %s; use version %d or later (the default, the current UTC time, usually is)",
			ErrConflict, name, v, ex.maxName, dir, ex.maxVersion+1)
	}
	return nil
}

// upStatements returns the statements of a goose migration's Up section
// (the whole file without goose annotations), without comment lines,
// surrounding white space and the final ";".
func upStatements(data []byte) []string {
	var body []string
	in := !bytes.Contains(data, []byte("-- +goose Up"))
	for _, line := range strings.Split(string(data), "\n") {
		line = strings.TrimRight(line, " \t\r")
		t := strings.TrimSpace(line)
		switch {
		case strings.HasPrefix(t, "-- +goose Up"):
			in = true
			continue
		case strings.HasPrefix(t, "-- +goose Down"):
			in = false
			continue
		}
		if in && !strings.HasPrefix(t, "--") {
			body = append(body, line)
		}
	}
	var out []string
	for _, st := range strings.Split(strings.Join(body, "\n")+"\n", ";\n") {
		if st = strings.TrimSpace(st); st != "" {
			out = append(out, st)
		}
	}
	return out
}

// checkTargetDir refuses directories of the pgfence module and paths whose
// existing part is not a directory.
func checkTargetDir(dir string) error {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("fencegen: %w", err)
	}
	existing := abs
	for {
		fi, err := os.Stat(existing)
		if err == nil {
			if !fi.IsDir() {
				return fmt.Errorf("fencegen: cannot use %s as a directory: %s is not a directory", dir, existing)
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("fencegen: %w", err)
		}
		parent := filepath.Dir(existing)
		if parent == existing {
			break
		}
		existing = parent
	}
	// Resolve symbolic links in the part that exists.
	real := abs
	if r, err := filepath.EvalSymlinks(existing); err == nil {
		rel, err := filepath.Rel(existing, abs)
		if err == nil {
			real = filepath.Join(r, rel)
		}
	}
	for d := real; ; d = filepath.Dir(d) {
		if mod, ok := modulePath(filepath.Join(d, "go.mod")); ok {
			if mod == pgfenceModule {
				return fmt.Errorf("%w: %s is in %s (module %s)", ErrPgfenceModule, dir, d, mod)
			}
			return nil
		}
		if filepath.Dir(d) == d {
			return nil
		}
	}
}

// modulePath reads the module path of a go.mod file.
func modulePath(gomod string) (string, bool) {
	data, err := os.ReadFile(gomod)
	if err != nil {
		return "", false
	}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "module" {
			return strings.Trim(f[1], "\"`"), true
		}
	}
	return "", true
}
