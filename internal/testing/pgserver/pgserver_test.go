package pgserver_test

import (
	"context"
	"errors"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/testing/pgserver"
)

func version(t *testing.T, dsn string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var v string
	if err := conn.QueryRow(ctx, "SHOW server_version").Scan(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// TestLocalBinaries checks the local-binaries path as pgserver exposes it
// (package localpg tests the cluster itself): a local server that Kill and
// Restart control and Stop removes.
func TestLocalBinaries(t *testing.T) {
	ctx := context.Background()
	s, err := pgserver.Start(ctx, pgserver.Options{NoContainers: true})
	if err != nil {
		t.Fatalf("local binaries: %v", err)
	}
	if s.Kind != pgserver.KindLocal || !s.Local() {
		t.Fatalf("kind = %s, local = %v; want %s", s.Kind, s.Local(), pgserver.KindLocal)
	}
	dir := s.DataDir()
	if _, err := os.Stat(filepath.Join(s.BinDir(), "pg_basebackup")); err != nil {
		t.Errorf("pg_basebackup not in BinDir %s: %v", s.BinDir(), err)
	}
	if v := version(t, s.DSN); v == "" {
		t.Fatal("empty server_version")
	}
	if err := s.Kill(syscall.SIGQUIT); err != nil {
		t.Fatal(err)
	}
	if err := s.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	version(t, s.DSN)
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("data dir %s still exists after Stop (err=%v)", dir, err)
	}
	if _, err := pgx.Connect(ctx, s.DSN); err == nil {
		t.Fatal("server still answers after Stop")
	}
	if err := s.Stop(); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
}

// TestDSNPath gives Start a DSN (here: one of a local cluster) and checks it is
// used as is, before any other way.
func TestDSNPath(t *testing.T) {
	ctx := context.Background()
	local, err := pgserver.Start(ctx, pgserver.Options{NoContainers: true})
	if err != nil {
		t.Fatal(err)
	}
	defer local.Stop()

	t.Setenv("PGFENCE_TEST_DSN_PATH", local.DSN)
	s, err := pgserver.Start(ctx, pgserver.Options{EnvVar: "PGFENCE_TEST_DSN_PATH"})
	if err != nil {
		t.Fatal(err)
	}
	if s.Kind != pgserver.KindDSN || s.DSN != local.DSN {
		t.Fatalf("got kind %s dsn %s, want the DSN from the environment", s.Kind, s.DSN)
	}
	version(t, s.DSN)
	if err := s.Stop(); err != nil { // leaves a DSN server alone
		t.Fatal(err)
	}
	version(t, local.DSN)

	// A DSN that does not answer is an error, not a silent fallback.
	t.Setenv("PGFENCE_TEST_DSN_PATH", "postgres://nobody@127.0.0.1:1/x?sslmode=disable&connect_timeout=2")
	_, err = pgserver.Start(ctx, pgserver.Options{EnvVar: "PGFENCE_TEST_DSN_PATH"})
	var ue *pgserver.UnavailableError
	if !errors.As(err, &ue) {
		t.Fatalf("err = %v, want *UnavailableError", err)
	}

	// A DSN pgx cannot parse: the error (it reaches test logs) says what
	// is wrong and shows no part of the password. pgx masks a password it
	// recognises in the string it quotes, but kept what follows an escaped
	// space.
	t.Setenv("PGFENCE_TEST_DSN_PATH", `host=127.0.0.1 port=abc user=ci password=hunter2\ topsecret`)
	_, err = pgserver.Start(ctx, pgserver.Options{EnvVar: "PGFENCE_TEST_DSN_PATH"})
	if !errors.As(err, &ue) {
		t.Fatalf("err = %v, want *UnavailableError", err)
	}
	if msg := err.Error(); strings.Contains(msg, "topsecret") || strings.Contains(msg, "hunter2") || !strings.Contains(msg, "invalid port") {
		t.Fatalf("err = %q; want what is wrong (invalid port) and no part of the password", msg)
	}
}

// needEngine returns when a Docker engine answers and the container path may
// run. Otherwise the test is reported as not run (it does not count as
// passed), except under PGFENCE_TEST_SERVER=testcontainers, where no engine
// fails it.
func needEngine(t *testing.T) {
	t.Helper()
	mode := os.Getenv(pgserver.EnvServer)
	if mode == pgserver.ServerLocal {
		t.Skipf("testcontainers path NOT RUN (not passed): %s=%s", pgserver.EnvServer, mode)
	}
	if err := pgserver.DockerAvailable(context.Background()); err != nil {
		if mode == pgserver.ServerTestcontainers {
			t.Fatalf("%s=%s, but: %v", pgserver.EnvServer, mode, err)
		}
		t.Skipf("testcontainers path NOT AVAILABLE here (not passed): %v", err)
	}
}

// TestTestcontainersPath runs the container path when a Docker engine answers
// and otherwise reports it as not available (it does not count as passed;
// under PGFENCE_TEST_SERVER=testcontainers it fails). The server must be a
// container reached on loopback, and Start must name the image and the
// container on its notices.
func TestTestcontainersPath(t *testing.T) {
	needEngine(t)
	var notices strings.Builder
	s, err := pgserver.Start(context.Background(), pgserver.Options{NoLocal: true, Notices: &notices})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	t.Logf("notices: %s", notices.String())
	if s.Kind != pgserver.KindTestcontainers {
		t.Fatalf("kind = %s, want %s", s.Kind, pgserver.KindTestcontainers)
	}
	u, err := url.Parse(s.DSN)
	if err != nil {
		t.Fatal(err)
	}
	if !pgserver.IsLoopbackHost(u.Hostname()) {
		t.Fatalf("DSN host %q is not a loopback host", u.Hostname())
	}
	if want := "pgserver: testcontainers: image " + pgserver.ContainerImage() + ", container "; !strings.Contains(notices.String(), want) {
		t.Errorf("notices %q do not contain %q", notices.String(), want)
	}
	version(t, s.DSN)
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := pgx.Connect(context.Background(), s.DSN+"&connect_timeout=2"); err == nil {
		t.Fatal("container still answers after Stop")
	}
}

// TestContainerFallback: when an engine answers but the image cannot be had,
// Start falls back to local binaries and says so on its notices, or, under
// PGFENCE_TEST_SERVER=testcontainers, returns the container's error. The
// image's registry is 127.0.0.1:1, where nothing listens: the engine's pull
// fails at once, without leaving the machine.
func TestContainerFallback(t *testing.T) {
	needEngine(t)
	const missing = "127.0.0.1:1/pgfence/no-such-image:0"
	t.Setenv(pgserver.EnvImage, missing)
	ctx := context.Background()

	t.Run("fallback", func(t *testing.T) {
		t.Setenv(pgserver.EnvServer, "")
		var notices strings.Builder
		s, err := pgserver.Start(ctx, pgserver.Options{Notices: &notices})
		if err != nil {
			t.Fatal(err)
		}
		defer s.Stop()
		t.Logf("notices: %s", notices.String())
		if s.Kind != pgserver.KindLocal {
			t.Fatalf("kind = %s, want %s", s.Kind, pgserver.KindLocal)
		}
		if len(s.Attempts) == 0 || s.Attempts[0].Kind != pgserver.KindTestcontainers || s.Attempts[0].Err == nil {
			t.Fatalf("attempts = %v, want a failed testcontainers attempt first", s.Attempts)
		}
		for _, want := range []string{"falling back to local binaries", missing} {
			if !strings.Contains(notices.String(), want) {
				t.Errorf("notices %q do not contain %q", notices.String(), want)
			}
		}
		version(t, s.DSN)
	})

	t.Run("forbidden", func(t *testing.T) {
		t.Setenv(pgserver.EnvServer, pgserver.ServerTestcontainers)
		var notices strings.Builder
		s, err := pgserver.Start(ctx, pgserver.Options{Notices: &notices})
		if err == nil {
			s.Stop()
			t.Fatalf("got a %s server, want an error", s.Kind)
		}
		var ue *pgserver.UnavailableError
		if !errors.As(err, &ue) {
			t.Fatalf("err = %v, want *UnavailableError", err)
		}
		for _, want := range []string{missing, "forbids the fallback"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not mention %q", err, want)
			}
		}
		if notices.Len() > 0 {
			t.Errorf("notices %q: no fallback was taken", notices.String())
		}
	})
}

// TestServerSwitch: PGFENCE_TEST_SERVER=local takes no container even with
// an engine; an unknown value is an error, not a silent default.
func TestServerSwitch(t *testing.T) {
	ctx := context.Background()
	t.Setenv(pgserver.EnvServer, pgserver.ServerLocal)
	s, err := pgserver.Start(ctx, pgserver.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	if s.Kind != pgserver.KindLocal {
		t.Fatalf("kind = %s, want %s", s.Kind, pgserver.KindLocal)
	}
	if a := s.Attempts[0]; a.Kind != pgserver.KindTestcontainers || a.Err == nil || !strings.Contains(a.Err.Error(), pgserver.EnvServer) {
		t.Fatalf("attempts = %v, want testcontainers disabled by %s", s.Attempts, pgserver.EnvServer)
	}

	t.Setenv(pgserver.EnvServer, "docker")
	if s, err := pgserver.Start(ctx, pgserver.Options{}); err == nil {
		s.Stop()
		t.Fatal("PGFENCE_TEST_SERVER=docker accepted")
	} else if !strings.Contains(err.Error(), pgserver.EnvServer) {
		t.Fatalf("error %q does not name %s", err, pgserver.EnvServer)
	}

	// A DSN still comes first.
	t.Setenv("PGFENCE_TEST_DSN_SWITCH", s.DSN)
	d, err := pgserver.Start(ctx, pgserver.Options{EnvVar: "PGFENCE_TEST_DSN_SWITCH"})
	if err != nil {
		t.Fatal(err)
	}
	if d.Kind != pgserver.KindDSN {
		t.Fatalf("kind = %s, want %s", d.Kind, pgserver.KindDSN)
	}
}

func TestContainerImage(t *testing.T) {
	if pgserver.DefaultImage != "postgres:15-alpine" {
		t.Fatalf("DefaultImage = %q, want the official postgres:15-alpine", pgserver.DefaultImage)
	}
	t.Setenv(pgserver.EnvImage, "")
	if got := pgserver.ContainerImage(); got != pgserver.DefaultImage {
		t.Fatalf("ContainerImage() = %q, want %q", got, pgserver.DefaultImage)
	}
	t.Setenv(pgserver.EnvImage, "pgfence/postgres-test:15")
	if got := pgserver.ContainerImage(); got != "pgfence/postgres-test:15" {
		t.Fatalf("ContainerImage() = %q with %s set", got, pgserver.EnvImage)
	}
	for host, want := range map[string]bool{"localhost": true, "127.0.0.1": true, "::1": true, "172.17.0.1": false, "example.com": false, "": false} {
		if got := pgserver.IsLoopbackHost(host); got != want {
			t.Errorf("IsLoopbackHost(%q) = %v, want %v", host, got, want)
		}
	}
}

// TestNothingAvailable checks the failure names what to install.
func TestNothingAvailable(t *testing.T) {
	_, err := pgserver.Start(context.Background(), pgserver.Options{NoContainers: true, NoLocal: true})
	var ue *pgserver.UnavailableError
	if !errors.As(err, &ue) {
		t.Fatalf("err = %v, want *UnavailableError", err)
	}
	for _, want := range []string{"PGFENCE_TEST_DATABASE_URL", "Docker", "apt-get install postgresql"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %q", err, want)
		}
	}
}
