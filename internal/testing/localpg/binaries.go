package localpg

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
)

// binGlob matches the binary directories of Debian's and Ubuntu's PostgreSQL
// packages, one per major version. A variable so tests can point it elsewhere.
var binGlob = "/usr/lib/postgresql/*/bin"

// FindBinDir returns the directory holding initdb, postgres and the other
// server binaries (pg_ctl, pg_basebackup, ...): the directory of postgres on
// PATH (links followed) when initdb is next to it, else the highest version
// under /usr/lib/postgresql/*/bin. It returns an error wrapping
// [ErrNoBinaries] when there is none.
func FindBinDir() (string, error) {
	if p, err := exec.LookPath("postgres"); err == nil {
		// PATH often holds links (Debian's /usr/local/bin or pg_wrapper):
		// follow them to the directory that also has pg_basebackup & co.
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		dir := filepath.Dir(p)
		if hasServer(dir) {
			return dir, nil
		}
	}
	dirs, _ := filepath.Glob(binGlob)
	sort.Slice(dirs, func(i, j int) bool { return versionOf(dirs[i]) > versionOf(dirs[j]) })
	for _, d := range dirs {
		if hasServer(d) {
			return d, nil
		}
	}
	return "", ErrNoBinaries
}

func hasServer(dir string) bool {
	for _, name := range []string{"initdb", "postgres"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			return false
		}
	}
	return true
}

// versionOf returns the major version of a /usr/lib/postgresql/VERSION/bin
// directory (9.6, 15, ...), or 0.
func versionOf(binDir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	return v
}

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("localpg: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}
