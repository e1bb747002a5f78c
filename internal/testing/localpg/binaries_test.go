//go:build unix

package localpg

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"testing"
)

// fakeBinDir makes dir hold files named like the server binaries.
func fakeBinDir(t *testing.T, dir string, names ...string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if err := os.WriteFile(filepath.Join(dir, n), []byte("#!/bin/sh\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
}

// TestFindBinDir: postgres on PATH (through a link) wins when initdb is next
// to it; else the highest major version under the versioned directories, by
// number (15 > 10 > 9.6), skipping one without initdb.
func TestFindBinDir(t *testing.T) {
	root := t.TempDir()
	old := binGlob
	binGlob = filepath.Join(root, "lib", "*", "bin")
	t.Cleanup(func() { binGlob = old })
	fakeBinDir(t, filepath.Join(root, "lib", "9.6", "bin"), "initdb", "postgres")
	fakeBinDir(t, filepath.Join(root, "lib", "10", "bin"), "initdb", "postgres")
	fakeBinDir(t, filepath.Join(root, "lib", "15", "bin"), "initdb", "postgres")
	fakeBinDir(t, filepath.Join(root, "lib", "16", "bin"), "postgres") // client-only leftovers

	t.Setenv("PATH", filepath.Join(root, "empty"))
	got, err := FindBinDir()
	if want := filepath.Join(root, "lib", "15", "bin"); err != nil || got != want {
		t.Fatalf("FindBinDir = %q, %v; want %q", got, err, want)
	}

	// A link on PATH is followed to the real directory.
	real := filepath.Join(root, "opt", "pg", "bin")
	fakeBinDir(t, real, "initdb", "postgres")
	linkDir := filepath.Join(root, "links")
	if err := os.Mkdir(linkDir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(real, "postgres"), filepath.Join(linkDir, "postgres")); err != nil {
		t.Fatal(err)
	}
	t.Setenv("PATH", linkDir)
	if got, err := FindBinDir(); err != nil || got != real {
		t.Fatalf("FindBinDir with a link on PATH = %q, %v; want %q", got, err, real)
	}
}

func TestServerArgs(t *testing.T) {
	args := serverArgs("/s", Options{})
	if !slices.Contains(args, "fsync=off") || !slices.Contains(args, "full_page_writes=off") {
		t.Errorf("default args %q lack fsync=off and full_page_writes=off", args)
	}
	if !slices.Contains(args, "unix_socket_directories=/s") {
		t.Errorf("args %q lack the socket directory", args)
	}
	args = serverArgs("/s", Options{Durable: true, Settings: map[string]string{"max_connections": "20", "fsync": "on"}})
	if slices.Contains(args, "fsync=off") || slices.Contains(args, "full_page_writes=off") || !slices.Contains(args, "fsync=on") {
		t.Errorf("durable args %q", args)
	}
	if !slices.Contains(args, "max_connections=20") || slices.Contains(args, "max_connections=400") {
		t.Errorf("Settings must override the defaults: %q", args)
	}
	for i := 0; i < len(args); i += 2 {
		if args[i] != "-c" {
			t.Fatalf("args %q: want -c name=value pairs", args)
		}
		if i >= 2 && args[i+1] < args[i-1] {
			t.Fatalf("args %q not in a stable (sorted) order", args)
		}
	}
}

// TestSweepStale removes the directories of dead owners only.
func TestSweepStale(t *testing.T) {
	root := t.TempDir()
	dead := exec.Command("true")
	if err := dead.Run(); err != nil {
		t.Fatal(err)
	}
	dirs := map[string]string{ // name → owner.pid content ("" = no file)
		dirPrefix + "dead":    strconv.Itoa(dead.Process.Pid),
		dirPrefix + "alive":   strconv.Itoa(os.Getpid()),
		dirPrefix + "nopid":   "",
		dirPrefix + "garbage": "not a pid",
		"other-dead":          strconv.Itoa(dead.Process.Pid),
	}
	for name, pid := range dirs {
		if err := os.Mkdir(filepath.Join(root, name), 0o755); err != nil {
			t.Fatal(err)
		}
		if pid != "" {
			if err := os.WriteFile(filepath.Join(root, name, "owner.pid"), []byte(pid), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	sweepStale(root)
	for name := range dirs {
		_, err := os.Stat(filepath.Join(root, name))
		if gone := os.IsNotExist(err); gone != (name == dirPrefix+"dead") {
			t.Errorf("%s: gone=%v after the sweep (stat: %v)", name, gone, err)
		}
	}
}
