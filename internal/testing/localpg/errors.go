package localpg

import "errors"

var (
	// ErrNoBinaries means the PostgreSQL server binaries (initdb, postgres)
	// were found neither on PATH nor under /usr/lib/postgresql/*/bin.
	ErrNoBinaries = errors.New("localpg: PostgreSQL server binaries not found (initdb and postgres on PATH or under /usr/lib/postgresql/*/bin)")

	// ErrNoUnprivilegedUser means the process runs as root, which PostgreSQL
	// refuses, and neither a "postgres" nor a "nobody" user exists to run the
	// cluster as.
	ErrNoUnprivilegedUser = errors.New("localpg: running as root and no unprivileged user (postgres or nobody) exists to run PostgreSQL")

	// ErrRunning is returned by [Cluster.Restart] when the cluster is running.
	ErrRunning = errors.New("localpg: cluster already running")

	// ErrStopped is returned by [Cluster.Restart] after [Cluster.Stop]: the
	// data directory is gone.
	ErrStopped = errors.New("localpg: cluster stopped and removed")

	// ErrUnsupported is returned by [Start] on systems other than Linux and
	// the other Unix systems.
	ErrUnsupported = errors.New("localpg: a throwaway cluster can only be started on Unix systems")
)
