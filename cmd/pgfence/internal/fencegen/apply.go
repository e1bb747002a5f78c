package fencegen

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
)

// Apply writes the plan's files: every file or none. Missing directories are
// created. Files are staged as ".pgfence-gen-*.tmp" temporaries and then moved
// into place; a file that appeared since Plan is never overwritten
// ([ErrFileExists]). If any step fails, Apply removes what it wrote and
// restores the query file it replaced; the error says so if that clean-up
// fails too. A crash between two renames can leave some files written:
// running the generator again with the same options finishes the job.
// Apply refuses to run twice.
func (wp *WritePlan) Apply() (err error) {
	if wp.applied {
		return errors.New("fencegen: plan already applied")
	}
	wp.applied = true
	if len(wp.ops) == 0 {
		return nil
	}
	type tempFile struct{ tmp, backup string }
	temps := make([]tempFile, len(wp.ops))
	var created []string // directories created here, parents first
	var committed []int  // ops moved into place
	defer func() {
		if err == nil {
			return
		}
		var undo []error
		for i := len(committed) - 1; i >= 0; i-- {
			o, t := wp.ops[committed[i]], temps[committed[i]]
			if o.update {
				if e := os.Rename(t.backup, o.path); e != nil {
					undo = append(undo, fmt.Errorf("could not restore %s: %w", o.path, e))
				}
			} else if e := os.Remove(o.path); e != nil {
				undo = append(undo, fmt.Errorf("could not remove %s: %w", o.path, e))
			}
		}
		for _, t := range temps {
			for _, name := range []string{t.tmp, t.backup} {
				if name == "" {
					continue
				}
				if e := os.Remove(name); e != nil && !errors.Is(e, fs.ErrNotExist) {
					undo = append(undo, fmt.Errorf("could not remove %s: %w", name, e))
				}
			}
		}
		for i := len(created) - 1; i >= 0; i-- {
			if e := os.Remove(created[i]); e != nil {
				undo = append(undo, fmt.Errorf("could not remove directory %s: %w", created[i], e))
			}
		}
		if len(undo) > 0 {
			err = fmt.Errorf("%w; clean-up incomplete: %w", err, errors.Join(undo...))
		} else {
			err = fmt.Errorf("%w (nothing written)", err)
		}
	}()

	for _, dir := range wp.mkdirs {
		c, err := mkdirAll(dir)
		created = append(created, c...)
		if err != nil {
			return fmt.Errorf("fencegen: %w", err)
		}
	}
	for i, o := range wp.ops {
		dir := filepath.Dir(o.path)
		if temps[i].tmp, err = writeTemp(dir, o.data, 0o644); err != nil {
			return err
		}
		if o.update {
			if temps[i].backup, err = writeTemp(dir, o.old, o.oldMode); err != nil {
				return err
			}
		}
	}
	for i, o := range wp.ops {
		if o.update {
			cur, err := os.ReadFile(o.path)
			if err != nil {
				return fmt.Errorf("fencegen: %w", err)
			}
			if !bytes.Equal(cur, o.old) {
				return fmt.Errorf("%w: %s changed since the plan was made", ErrConflict, o.path)
			}
			if err := os.Rename(temps[i].tmp, o.path); err != nil {
				return fmt.Errorf("fencegen: %w", err)
			}
			temps[i].tmp = ""
		} else if err := linkNew(temps[i].tmp, o.path); err != nil {
			return err
		}
		committed = append(committed, i)
	}
	for _, t := range temps {
		for _, name := range []string{t.tmp, t.backup} {
			if name != "" {
				_ = os.Remove(name) // a leftover temporary is harmless
			}
		}
	}
	seen := map[string]bool{}
	for _, o := range wp.ops {
		if dir := filepath.Dir(o.path); !seen[dir] {
			seen[dir] = true
			syncDir(dir)
		}
	}
	return nil
}

// mkdirAll is os.MkdirAll that reports the directories it created.
func mkdirAll(dir string) ([]string, error) {
	var missing []string
	for d := filepath.Clean(dir); ; d = filepath.Dir(d) {
		_, err := os.Stat(d)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		missing = append(missing, d)
		if filepath.Dir(d) == d {
			break
		}
	}
	var created []string
	for i := len(missing) - 1; i >= 0; i-- {
		err := os.Mkdir(missing[i], 0o755)
		if err == nil {
			created = append(created, missing[i])
		} else if !errors.Is(err, fs.ErrExist) {
			return created, err
		}
	}
	return created, nil
}

// writeTemp writes data to a new temporary file in dir and syncs it.
func writeTemp(dir string, data []byte, perm fs.FileMode) (string, error) {
	for range 100 {
		name := filepath.Join(dir, ".pgfence-gen-"+strconv.FormatUint(rand.Uint64(), 36)+".tmp")
		fh, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		if err != nil {
			return "", fmt.Errorf("fencegen: %w", err)
		}
		_, err = fh.Write(data)
		if err == nil {
			err = fh.Sync()
		}
		if cerr := fh.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			_ = os.Remove(name)
			return "", fmt.Errorf("fencegen: %w", err)
		}
		return name, nil
	}
	return "", fmt.Errorf("fencegen: no free temporary file name in %s", dir)
}

// linkNew puts tmp in place at path unless path exists. A hard link does it
// atomically; on file systems without hard links, a check and a rename.
func linkNew(tmp, path string) error {
	err := os.Link(tmp, path)
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("%w: %s appeared since the plan was made", ErrFileExists, path)
	}
	if err == nil {
		return nil
	}
	if _, serr := os.Lstat(path); !errors.Is(serr, fs.ErrNotExist) {
		return fmt.Errorf("%w: %s appeared since the plan was made", ErrFileExists, path)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("fencegen: %w", err)
	}
	return nil
}

// syncDir makes the renames in dir durable where the file system allows.
func syncDir(dir string) {
	if fh, err := os.Open(dir); err == nil {
		_ = fh.Sync()
		_ = fh.Close()
	}
}
