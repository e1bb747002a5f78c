// Package pgserver finds or starts a PostgreSQL server for pgfence's tests and
// benchmarks.
//
// [Start] tries, in order:
//
//  1. a DSN given in [Options.DSN] or in the environment variable named by
//     [Options.EnvVar] (for tests: PGFENCE_TEST_DATABASE_URL);
//  2. testcontainers-go's postgres module, when a Docker engine answers, with
//     the image named by PGFENCE_TEST_IMAGE ([EnvImage]; default
//     postgres:15-alpine, the official image from Docker Hub). The DSN must
//     point to a loopback host;
//  3. a throwaway cluster made from the PostgreSQL server binaries found on PATH or
//     under /usr/lib/postgresql/*/bin, started by package localpg: initdb in a
//     temporary directory, then the postmaster as a child process listening on
//     127.0.0.1 and a unix socket inside that directory, as the "postgres" user
//     (or "nobody") when the current process is root.
//
// The environment variable PGFENCE_TEST_SERVER ([EnvServer]) changes the
// order after the DSN: "testcontainers" forbids the fallback to local
// binaries (a failed container attempt, no engine included, is Start's
// error: CI uses it to prove the container path was taken), "local" skips
// containers. A caller's [Options.NoContainers] still gets a local cluster.
//
// When an engine answers but no container could be had, Start says so on
// [Options.Notices] (stderr) before it falls back; it also says there which
// image and container it took. No engine is the common case and is silent.
//
// If none of these works, Start returns an [*UnavailableError] that names what to
// install. A local cluster dies with the process that started it even when that
// process is killed (Linux); its directory is removed by [Server.Stop], and
// directories left behind by a process that died are swept by the next Start.
//
// pgserver links testcontainers and the Docker client: it is for tests and the
// bench module only. Programs shipped to users (cmd/pgfence) use localpg.
package pgserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/testing/localpg"
)

// Kind names the way a server was obtained.
type Kind string

// The kinds of server, in the order Start tries them.
const (
	KindDSN            Kind = "dsn"
	KindTestcontainers Kind = "testcontainers"
	KindLocal          Kind = "local-binaries"
)

// EnvServer names the environment variable that restricts the ways [Start]
// tries after a DSN: [ServerTestcontainers], [ServerLocal], or unset (both,
// in the documented order).
const EnvServer = "PGFENCE_TEST_SERVER"

// The values of [EnvServer].
const (
	// ServerTestcontainers: containers only; a failed container attempt is
	// Start's error instead of a fallback to local binaries.
	ServerTestcontainers = "testcontainers"
	// ServerLocal: local binaries only; no container is tried.
	ServerLocal = "local"
)

// serverMode reads [EnvServer].
func serverMode() (string, error) {
	switch v := strings.TrimSpace(os.Getenv(EnvServer)); v {
	case "", ServerTestcontainers, ServerLocal:
		return v, nil
	default:
		return "", fmt.Errorf("pgserver: %s=%q: want %q, %q or unset", EnvServer, v, ServerTestcontainers, ServerLocal)
	}
}

// Options configure [Start]. The zero value is usable.
type Options struct {
	// DSN, when set, is used as is and nothing is started.
	DSN string
	// EnvVar names an environment variable that may hold a DSN. Ignored when DSN
	// is set. Defaults to no variable.
	EnvVar string
	// Durable keeps PostgreSQL's default durability (fsync on). By default a
	// local cluster runs with fsync and full_page_writes off, which is safe for
	// throwaway test data only.
	Durable bool
	// Settings are extra server settings (name → value) for a local cluster,
	// passed as -c name=value.
	Settings map[string]string
	// NoContainers skips the testcontainers attempt.
	NoContainers bool
	// NoLocal skips the local-binaries attempt.
	NoLocal bool
	// Log receives progress lines. Defaults to io.Discard.
	Log io.Writer
	// Notices receives the lines that must not go unseen: the image and
	// container the testcontainers path took, or why it fell back to local
	// binaries although an engine answered. Defaults to os.Stderr.
	Notices io.Writer
}

// Attempt records one way of getting a server that Start tried.
type Attempt struct {
	Kind Kind
	Err  error // nil when this attempt produced the server
}

// UnavailableError is returned by [Start] when no server could be had.
type UnavailableError struct {
	Attempts []Attempt
}

func (e *UnavailableError) Error() string {
	var b strings.Builder
	b.WriteString("pgserver: no PostgreSQL server available: ")
	for i, a := range e.Attempts {
		if i > 0 {
			b.WriteString("; ")
		}
		fmt.Fprintf(&b, "%s: %v", a.Kind, a.Err)
	}
	b.WriteString(". To fix: set PGFENCE_TEST_DATABASE_URL to a server where the user may CREATE DATABASE, " +
		"or start a Docker engine, or install the PostgreSQL server binaries " +
		"(Debian/Ubuntu: apt-get install postgresql; initdb, pg_ctl and postgres are looked up on PATH " +
		"and under /usr/lib/postgresql/*/bin)")
	return b.String()
}

// Server is a PostgreSQL server ready for connections.
type Server struct {
	// Kind says how the server was obtained.
	Kind Kind
	// DSN connects as a superuser (or the DSN's user) to an existing database.
	DSN string
	// Attempts lists every way Start tried, including those that failed.
	Attempts []Attempt

	local     *localpg.Cluster
	terminate func(context.Context) error
	stopOnce  sync.Once
	stopErr   error
}

// Start finds or starts a server in the order described in the package doc.
func Start(ctx context.Context, opts Options) (*Server, error) {
	logw := opts.Log
	if logw == nil {
		logw = io.Discard
	}
	notices := opts.Notices
	if notices == nil {
		notices = os.Stderr
	}
	var attempts []Attempt

	dsn := opts.DSN
	if dsn == "" && opts.EnvVar != "" {
		dsn = os.Getenv(opts.EnvVar)
	}
	if dsn != "" {
		if err := ping(ctx, dsn); err != nil {
			attempts = append(attempts, Attempt{KindDSN, err})
			return nil, &UnavailableError{Attempts: attempts}
		}
		attempts = append(attempts, Attempt{Kind: KindDSN})
		return &Server{Kind: KindDSN, DSN: dsn, Attempts: attempts}, nil
	}
	if opts.EnvVar != "" {
		attempts = append(attempts, Attempt{KindDSN, fmt.Errorf("%s is not set", opts.EnvVar)})
	}

	mode, err := serverMode()
	if err != nil {
		return nil, err
	}
	switch {
	case opts.NoContainers:
		attempts = append(attempts, Attempt{KindTestcontainers, errors.New("disabled")})
	case mode == ServerLocal:
		attempts = append(attempts, Attempt{KindTestcontainers, fmt.Errorf("disabled by %s=%s", EnvServer, mode)})
	default:
		s, err := startContainer(ctx, logw, notices)
		if err == nil {
			s.Attempts = append(attempts, Attempt{Kind: KindTestcontainers})
			return s, nil
		}
		attempts = append(attempts, Attempt{KindTestcontainers, err})
		if mode == ServerTestcontainers {
			attempts = append(attempts, Attempt{KindLocal, fmt.Errorf("not tried: %s=%s forbids the fallback", EnvServer, mode)})
			return nil, &UnavailableError{Attempts: attempts}
		}
		if _, noEngine := errors.AsType[*NoEngineError](err); !noEngine && !opts.NoLocal {
			fmt.Fprintf(notices, "pgserver: testcontainers: a Docker engine answers but no container could be had (%v); falling back to local binaries\n", err)
		}
	}

	if opts.NoLocal {
		attempts = append(attempts, Attempt{KindLocal, errors.New("disabled")})
		return nil, &UnavailableError{Attempts: attempts}
	}
	lc, err := localpg.Start(ctx, localpg.Options{
		Durable:  opts.Durable,
		Settings: opts.Settings,
		Log:      logw,
	})
	if err != nil {
		attempts = append(attempts, Attempt{KindLocal, err})
		return nil, &UnavailableError{Attempts: attempts}
	}
	attempts = append(attempts, Attempt{Kind: KindLocal})
	return &Server{Kind: KindLocal, DSN: lc.DSN(), Attempts: attempts, local: lc}, nil
}

// Stop shuts the server down and removes what Start created. A DSN server is
// left alone. Stop is safe to call more than once.
func (s *Server) Stop() error {
	s.stopOnce.Do(func() {
		switch {
		case s.local != nil:
			s.stopErr = s.local.Stop()
		case s.terminate != nil:
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			s.stopErr = s.terminate(ctx)
		}
	})
	return s.stopErr
}

// Local reports whether the server is a local cluster this process controls, so
// that [Server.Kill] and [Server.Restart] can be used (fault tests).
func (s *Server) Local() bool { return s.local != nil }

// DataDir returns the data directory of a local cluster, or "".
func (s *Server) DataDir() string {
	if s.local == nil {
		return ""
	}
	return s.local.DataDir()
}

// BinDir returns the directory of the PostgreSQL binaries of a local cluster, or "".
func (s *Server) BinDir() string {
	if s.local == nil {
		return ""
	}
	return s.local.BinDir()
}

// Kill stops a local cluster without removing its data: sig SIGQUIT is an
// immediate shutdown (crash recovery at the next start), SIGINT a fast one.
func (s *Server) Kill(sig syscall.Signal) error {
	if s.local == nil {
		return errors.New("pgserver: Kill needs a local cluster")
	}
	return s.local.Kill(sig)
}

// Restart starts a local cluster stopped by [Server.Kill] again, on the same
// port and data directory, and waits until it accepts connections.
func (s *Server) Restart(ctx context.Context) error {
	if s.local == nil {
		return errors.New("pgserver: Restart needs a local cluster")
	}
	return s.local.Restart(ctx)
}

func ping(ctx context.Context, dsn string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return withoutConnString(err)
	}
	defer conn.Close(context.Background())
	return conn.Ping(ctx)
}

// withoutConnString returns err, or, for an error of pgx's connection
// string parser, one without the string it quotes (see
// pgerr.ParseConfigText): the error reaches test logs.
func withoutConnString(err error) error {
	rest, ok := pgerr.ParseConfigText(err)
	if !ok {
		return err
	}
	return fmt.Errorf("cannot parse the connection string (not shown): %s", rest)
}

// FindBinDir returns the directory holding the PostgreSQL server binaries; see
// [localpg.FindBinDir].
func FindBinDir() (string, error) { return localpg.FindBinDir() }

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func FreePort() (int, error) { return localpg.FreePort() }
