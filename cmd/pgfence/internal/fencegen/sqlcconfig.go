package fencegen

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// ErrSQLCConfig reports a sqlc configuration file fencegen cannot take the
// directories from: unreadable, an unknown version, no postgresql block,
// several blocks and none chosen, or several schema or query directories.
var ErrSQLCConfig = errors.New("fencegen: sqlc config")

// sqlcConfigNames are the configuration file names sqlc looks for, in order.
var sqlcConfigNames = []string{"sqlc.yaml", "sqlc.yml", "sqlc.json"}

// FindSQLCConfig returns the path of the sqlc configuration file in dir, as
// sqlc looks for it (sqlc.yaml, then sqlc.yml, then sqlc.json), or "" when
// there is none. Like sqlc it refuses a directory holding both sqlc.json and
// sqlc.yaml or sqlc.yml.
func FindSQLCConfig(dir string) (string, error) {
	var found []string
	for _, name := range sqlcConfigNames {
		path := filepath.Join(dir, name)
		fi, err := os.Stat(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("%w: %w", ErrSQLCConfig, err)
		}
		if fi.Mode().IsRegular() {
			found = append(found, path)
		}
	}
	switch {
	case len(found) == 0:
		return "", nil
	case strings.HasSuffix(found[len(found)-1], "sqlc.json") && len(found) > 1:
		return "", fmt.Errorf("%w: both %s and %s exist (sqlc refuses that too)", ErrSQLCConfig, found[0], found[len(found)-1])
	}
	return found[0], nil
}

// SQLCConfig is what fencegen reads of a sqlc configuration file (version 1
// or 2, YAML or JSON): the blocks and their schema and query paths.
type SQLCConfig struct {
	// Path is the file read; relative paths in it are relative to its directory.
	Path   string
	Blocks []SQLCBlock
}

// SQLCBlock is one sql[] block (version 2) or packages[] entry (version 1).
type SQLCBlock struct {
	// Name is the block's name (version 1: the package name, defaulting to
	// the last element of its path, as sqlc does).
	Name string
	// Package is gen.go.package (version 2) or the package name (version 1).
	Package string
	// Engine is "postgresql", "mysql" or "sqlite" (version 1 defaults to postgresql).
	Engine string
	// Schema and Queries are the paths as written in the file.
	Schema, Queries []string
}

// sqlcPaths is a path or a list of paths, as sqlc accepts.
type sqlcPaths []string

func (p *sqlcPaths) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		var s string
		if err := n.Decode(&s); err != nil {
			return err
		}
		*p = sqlcPaths{s}
		return nil
	}
	var l []string
	if err := n.Decode(&l); err != nil {
		return err
	}
	*p = l
	return nil
}

type sqlcFile struct {
	Version string `yaml:"version"`
	SQL     []struct {
		Name    string    `yaml:"name"`
		Engine  string    `yaml:"engine"`
		Schema  sqlcPaths `yaml:"schema"`
		Queries sqlcPaths `yaml:"queries"`
		Gen     struct {
			Go struct {
				Package string `yaml:"package"`
			} `yaml:"go"`
		} `yaml:"gen"`
	} `yaml:"sql"`
	Packages []struct {
		Name    string    `yaml:"name"`
		Path    string    `yaml:"path"`
		Engine  string    `yaml:"engine"`
		Schema  sqlcPaths `yaml:"schema"`
		Queries sqlcPaths `yaml:"queries"`
	} `yaml:"packages"`
}

// ReadSQLCConfig reads a sqlc configuration file (YAML or JSON; JSON is
// read as YAML, as sqlc does).
func ReadSQLCConfig(path string) (*SQLCConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrSQLCConfig, err)
	}
	var f sqlcFile
	if err := yaml.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrSQLCConfig, path, err)
	}
	c := &SQLCConfig{Path: path}
	switch f.Version {
	case "2":
		for _, b := range f.SQL {
			c.Blocks = append(c.Blocks, SQLCBlock{Name: b.Name, Package: b.Gen.Go.Package, Engine: b.Engine,
				Schema: b.Schema, Queries: b.Queries})
		}
	case "1":
		for _, b := range f.Packages {
			if b.Name == "" {
				b.Name = filepath.Base(b.Path)
			}
			if b.Engine == "" {
				b.Engine = "postgresql"
			}
			c.Blocks = append(c.Blocks, SQLCBlock{Name: b.Name, Package: b.Name, Engine: b.Engine,
				Schema: b.Schema, Queries: b.Queries})
		}
	case "":
		return nil, fmt.Errorf("%w: %s has no version", ErrSQLCConfig, path)
	default:
		return nil, fmt.Errorf("%w: %s: unknown version %q (want \"1\" or \"2\")", ErrSQLCConfig, path, f.Version)
	}
	return c, nil
}

func (b SQLCBlock) label(i int) string {
	switch {
	case b.Name != "":
		return b.Name
	case b.Package != "":
		return b.Package
	}
	return "#" + strconv.Itoa(i+1)
}

// Dirs returns the directories of a postgresql block: the directory of its
// schema (where goose migrations go, since sqlc reads them as the schema)
// and of its queries. block chooses the block by name or Go package; ""
// picks the only postgresql block and fails when there are several. A path
// naming a file (or a glob pattern) stands for its directory, and a note
// says that sqlc will not read a new file there unless the configuration
// lists it; a path that does not exist yet is a directory unless it ends in
// ".sql". When a block lists several paths, the one directory among them
// is used (several directories are an error).
func (c *SQLCConfig) Dirs(block string) (Dirs, []string, error) {
	var pick []int
	var pg []string
	for i, b := range c.Blocks {
		if b.Engine == "postgresql" {
			pg = append(pg, b.label(i))
		}
		if block == "" && b.Engine == "postgresql" || block != "" && (b.Name == block || b.Package == block) {
			pick = append(pick, i)
		}
	}
	switch {
	case block != "" && len(pick) == 0:
		return Dirs{}, nil, fmt.Errorf("%w: %s has no block named %q (postgresql blocks: %s)",
			ErrSQLCConfig, c.Path, block, strings.Join(pg, ", "))
	case len(pick) == 0:
		return Dirs{}, nil, fmt.Errorf("%w: %s has no postgresql block", ErrSQLCConfig, c.Path)
	case len(pick) > 1 && block != "":
		return Dirs{}, nil, fmt.Errorf("%w: %s has %d blocks named %q", ErrSQLCConfig, c.Path, len(pick), block)
	case len(pick) > 1:
		return Dirs{}, nil, fmt.Errorf("%w: %s has %d postgresql blocks (%s): choose one",
			ErrSQLCConfig, c.Path, len(pick), strings.Join(pg, ", "))
	}
	b := c.Blocks[pick[0]]
	if b.Engine != "postgresql" {
		return Dirs{}, nil, fmt.Errorf("%w: block %q of %s has engine %q, not postgresql", ErrSQLCConfig, block, c.Path, b.Engine)
	}
	base := filepath.Dir(c.Path)
	var notes []string
	mig, note, err := sqlcDir(base, b.Schema, "schema")
	if err != nil {
		return Dirs{}, nil, fmt.Errorf("%w: %s, block %s: %w", ErrSQLCConfig, c.Path, b.label(pick[0]), err)
	}
	if note != "" {
		notes = append(notes, note)
	}
	qry, note, err := sqlcDir(base, b.Queries, "queries")
	if err != nil {
		return Dirs{}, nil, fmt.Errorf("%w: %s, block %s: %w", ErrSQLCConfig, c.Path, b.label(pick[0]), err)
	}
	if note != "" {
		notes = append(notes, note)
	}
	return Dirs{Migrations: mig, Queries: qry}, notes, nil
}

// sqlcDir turns a block's schema or queries paths into one directory.
func sqlcDir(base string, paths []string, key string) (string, string, error) {
	if len(paths) == 0 {
		return "", "", fmt.Errorf("no %s path", key)
	}
	var dirs, fileDirs, files []string
	add := func(l []string, d string) []string {
		for _, x := range l {
			if x == d {
				return l
			}
		}
		return append(l, d)
	}
	for _, p := range paths {
		full := p
		if !filepath.IsAbs(full) {
			full = filepath.Join(base, p)
		}
		if strings.ContainsAny(p, "*?[]") {
			d := filepath.Dir(full)
			if strings.ContainsAny(d, "*?[]") {
				return "", "", fmt.Errorf("%s pattern %q has wildcards in its directory part", key, p)
			}
			fileDirs, files = add(fileDirs, d), append(files, p)
			continue
		}
		fi, err := os.Stat(full)
		switch {
		case err == nil && fi.IsDir(), errors.Is(err, fs.ErrNotExist) && !strings.HasSuffix(p, ".sql"):
			dirs = add(dirs, full)
		case err == nil, errors.Is(err, fs.ErrNotExist):
			fileDirs, files = add(fileDirs, filepath.Dir(full)), append(files, p)
		default:
			return "", "", err
		}
	}
	switch {
	case len(dirs) == 1:
		return dirs[0], "", nil
	case len(dirs) > 1:
		return "", "", fmt.Errorf("%s lists several directories (%s)", key, strings.Join(dirs, ", "))
	case len(fileDirs) == 1:
		return fileDirs[0], fmt.Sprintf("sqlc's %s is %s, not a directory: sqlc reads only what is listed, so add the generated file to %s in the sqlc configuration",
			key, strings.Join(files, ", "), key), nil
	}
	return "", "", fmt.Errorf("%s lists files in several directories (%s)", key, strings.Join(fileDirs, ", "))
}
