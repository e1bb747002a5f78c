// Package pgtest gives every pgfence test its own migrated PostgreSQL database.
//
// The server is found or started once per test binary by [pgserver.Start] in
// the documented fallback order (PGFENCE_TEST_DATABASE_URL, testcontainers,
// local binaries). A template database is migrated once; each test gets a clone
// of it ([Pool], [DSN]), so tests may call t.Parallel() and never see each
// other's locks. If no server can be had, the calling test fails with a message
// saying what to install: DB tests are never skipped.
//
// Use [Main] from TestMain so the server is stopped when the tests end:
//
//	func TestMain(m *testing.M) { pgtest.Main(m) }
//
// Examples connect the way an application does, through an environment
// variable; [ExportDSN] makes Main give them a database of their own:
//
//	func TestMain(m *testing.M) { pgtest.Main(m, pgtest.ExportDSN("DATABASE_URL")) }
package pgtest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/pgfence/pgfence/internal/testing/pgserver"
	"github.com/pgfence/pgfence/migrations"
)

// EnvDSN names the environment variable that points the tests at an existing
// server. Its user must be allowed to CREATE DATABASE.
const EnvDSN = "PGFENCE_TEST_DATABASE_URL"

var (
	mu       sync.Mutex
	srv      *pgserver.Server
	srvErr   error
	tmplName string
	tmplErr  error
	tmplOnce sync.Once
	seq      atomic.Int64
	runID    = fmt.Sprintf("%d_%04d", os.Getpid()%100000, rand.IntN(10000))
)

// Main runs the tests, stops the server, and fails the binary if goroutines
// leaked. Use it as the body of TestMain.
func Main(m *testing.M, opts ...Option) {
	var o mainOptions
	for _, opt := range opts {
		opt(&o)
	}
	code := 1
	if drop, err := o.export(); err != nil {
		fmt.Fprintf(os.Stderr, "pgtest: %v\n", err)
	} else {
		code = m.Run()
		drop()
	}
	Shutdown()
	if code == 0 {
		if err := goleak.Find(ignoredGoroutines()...); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

// Option configures [Main].
type Option func(*mainOptions)

type mainOptions struct {
	env      string // "" when nothing is exported
	migrated bool
}

// ExportDSN makes [Main] create a database with pgfence's migrations applied
// (as [DSN] does) before the tests run, and set the environment variable env
// to its DSN: for examples, which read their DSN as an application does.
// The database is dropped when the tests end. If no server can be had, Main
// fails the binary with the message that says what to install.
func ExportDSN(env string) Option {
	return func(o *mainOptions) { o.env, o.migrated = env, true }
}

// ExportEmptyDSN is [ExportDSN] with an empty database (see [EmptyDSN]), for
// examples that apply the migrations themselves.
func ExportEmptyDSN(env string) Option {
	return func(o *mainOptions) { o.env, o.migrated = env, false }
}

// export creates the database of the options, if any, and sets the variable.
// drop removes the database again.
func (o mainOptions) export() (drop func(), err error) {
	if o.env == "" {
		return func() {}, nil
	}
	s, err := server()
	if err != nil {
		return nil, err
	}
	template := ""
	if o.migrated {
		tmplOnce.Do(func() { tmplErr = makeTemplate(s) })
		if tmplErr != nil {
			return nil, fmt.Errorf("migrate template database: %w", tmplErr)
		}
		template = tmplName
	}
	name, err := createDatabase(s, template)
	if err != nil {
		return nil, err
	}
	if err := os.Setenv(o.env, withDatabase(s.DSN, name)); err != nil {
		dropDatabase(s, name)
		return nil, err
	}
	return func() { dropDatabase(s, name) }, nil
}

func ignoredGoroutines() []goleak.Option {
	return []goleak.Option{
		// testcontainers' reaper and docker client keep goroutines of their own.
		goleak.IgnoreAnyFunction("github.com/testcontainers/testcontainers-go.(*Reaper).connect.func1"),
	}
}

// Shutdown drops the template database and stops a server this process started.
func Shutdown() {
	mu.Lock()
	defer mu.Unlock()
	if srv == nil {
		return
	}
	if tmplName != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if conn, err := pgx.Connect(ctx, srv.DSN); err == nil {
			_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{tmplName}.Sanitize()+" WITH (FORCE)")
			_ = conn.Close(ctx)
		}
		cancel()
	}
	_ = srv.Stop()
	srv = nil
}

// Server returns the shared server, starting it on first use. The test fails
// (never skips) when no server can be had.
func Server(t testing.TB) *pgserver.Server {
	t.Helper()
	s, err := server()
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return s
}

func server() (*pgserver.Server, error) {
	mu.Lock()
	defer mu.Unlock()
	if srv != nil || srvErr != nil {
		return srv, srvErr
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	srv, srvErr = pgserver.Start(ctx, pgserver.Options{EnvVar: EnvDSN})
	return srv, srvErr
}

// AdminDSN returns a DSN for the server's maintenance database.
func AdminDSN(t testing.TB) string {
	t.Helper()
	return Server(t).DSN
}

// EmptyDSN creates a fresh, unmigrated database for t and returns its DSN. The
// database is dropped when t ends.
func EmptyDSN(t testing.TB) string {
	t.Helper()
	return createDB(t, "")
}

// DSN creates a fresh database with pgfence's migrations applied and returns
// its DSN. The database is dropped when t ends.
func DSN(t testing.TB) string {
	t.Helper()
	s := Server(t)
	tmplOnce.Do(func() { tmplErr = makeTemplate(s) })
	if tmplErr != nil {
		t.Fatalf("pgtest: migrate template database: %v", tmplErr)
	}
	return createDB(t, tmplName)
}

// Pool returns a pool on a fresh migrated database (see [DSN]); it is closed
// when t ends.
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return PoolFor(t, DSN(t))
}

// PoolFor opens a pool on dsn that is closed when t ends.
func PoolFor(t testing.TB, dsn string) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		t.Fatalf("pgtest: open pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func makeTemplate(s *pgserver.Server) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	name := "pgfence_tpl_" + runID
	admin, err := pgx.Connect(ctx, s.DSN)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return err
	}
	tmplName = name
	pool, err := pgxpool.New(ctx, withDatabase(s.DSN, name))
	if err != nil {
		return err
	}
	defer pool.Close()
	return migrations.UpPool(ctx, pool)
}

func createDB(t testing.TB, template string) string {
	t.Helper()
	s := Server(t)
	name, err := createDatabase(s, template)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() { dropDatabase(s, name) })
	return withDatabase(s.DSN, name)
}

// createDatabase creates a database with a name of this run, from template
// when it is not "", and returns its name.
func createDatabase(s *pgserver.Server, template string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := fmt.Sprintf("pgfence_t_%s_%d", runID, seq.Add(1))
	admin, err := pgx.Connect(ctx, s.DSN)
	if err != nil {
		return "", fmt.Errorf("connect: %w", err)
	}
	defer admin.Close(context.Background())
	stmt := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if template != "" {
		stmt += " TEMPLATE " + pgx.Identifier{template}.Sanitize()
		if admin.PgConn().ParameterStatus("server_version") >= "15" {
			// FILE_COPY avoids WAL-logging every block of a small template.
			stmt += " STRATEGY FILE_COPY"
		}
	}
	if _, err := admin.Exec(ctx, stmt); err != nil {
		return "", fmt.Errorf("%s: %w", stmt, err)
	}
	return name, nil
}

// dropDatabase drops database name, ending its sessions; a server that is
// already gone took it with it.
func dropDatabase(s *pgserver.Server, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.DSN)
	if err != nil {
		return
	}
	defer conn.Close(ctx)
	_, _ = conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
}

// withDatabase replaces the database of a URL- or keyword-style DSN.
func withDatabase(dsn, db string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + db
		return u.String()
	}
	// Keyword/value form: a later keyword overrides an earlier one.
	return dsn + " dbname=" + db
}

// TerminateBackends ends, with pg_terminate_backend, every backend of the
// current database whose application_name is app, waits until they have
// exited, and returns how many it ended.
func TerminateBackends(t testing.TB, ctx context.Context, admin *pgxpool.Pool, app string) int {
	t.Helper()
	var pids []int32
	if err := admin.QueryRow(ctx, `SELECT coalesce(array_agg(pid) FILTER (WHERE pg_terminate_backend(pid)), '{}')
		FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1`, app).Scan(&pids); err != nil {
		t.Fatalf("pgtest: terminate backends of %q: %v", app, err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		var alive bool
		if err := admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = ANY($1))`, pids).Scan(&alive); err != nil {
			t.Fatalf("pgtest: terminated backends of %q: %v", app, err)
		}
		if !alive {
			return len(pids)
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgtest: backends %v of %q still there 10s after pg_terminate_backend", pids, app)
		}
		time.Sleep(2 * time.Millisecond) // no signal exists for a backend's exit
	}
}
