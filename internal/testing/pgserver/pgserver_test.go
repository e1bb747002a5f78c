package pgserver_test

import (
	"context"
	"errors"
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
}

// TestTestcontainersPath runs the container path when a Docker engine answers
// and otherwise reports it as not available (it does not count as passed).
func TestTestcontainersPath(t *testing.T) {
	ctx := context.Background()
	if err := pgserver.DockerAvailable(ctx); err != nil {
		t.Skipf("testcontainers path NOT AVAILABLE here (not passed): %v", err)
	}
	s, err := pgserver.Start(ctx, pgserver.Options{NoLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	if s.Kind != pgserver.KindTestcontainers {
		t.Fatalf("kind = %s", s.Kind)
	}
	version(t, s.DSN)
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
