package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/testing/pgserver"
	"github.com/pgfence/pgfence/migrations"
)

// pgEnv is the PostgreSQL server of the run and the database the pgfence
// scenarios use (all migrations applied).
type pgEnv struct {
	srv      *pgserver.Server
	benchDSN string
	pool     *pgxpool.Pool
	version  string
	fsync    string
	syncCmt  string
}

const benchDB = "pgfence_bench"

// startPG starts (or connects to, with dsn) a server with default durability
// and prepares the bench database.
func startPG(ctx context.Context, dsn string, logw io.Writer) (*pgEnv, error) {
	srv, err := pgserver.Start(ctx, pgserver.Options{DSN: dsn, Durable: true, NoContainers: true, Log: logw})
	if err != nil {
		return nil, err
	}
	env := &pgEnv{srv: srv}
	ok := false
	defer func() {
		if !ok {
			env.close()
		}
	}()
	if env.benchDSN, err = env.createDB(ctx, benchDB); err != nil {
		return nil, err
	}
	if env.pool, err = newPool(ctx, env.benchDSN, 48); err != nil {
		return nil, err
	}
	if err := migrations.UpPool(ctx, env.pool); err != nil {
		return nil, err
	}
	row := env.pool.QueryRow(ctx, "SELECT current_setting('server_version'), current_setting('fsync'), current_setting('synchronous_commit')")
	if err := row.Scan(&env.version, &env.fsync, &env.syncCmt); err != nil {
		return nil, err
	}
	ok = true
	return env, nil
}

func (e *pgEnv) close() {
	if e.pool != nil {
		e.pool.Close()
	}
	if e.srv != nil {
		_ = e.srv.Stop()
	}
}

// dbDSN returns the server's DSN pointed at database name.
func (e *pgEnv) dbDSN(name string) (string, error) {
	u, err := url.Parse(e.srv.DSN)
	if err != nil {
		return "", fmt.Errorf("parse server DSN: %w", err)
	}
	u.Path = "/" + name
	return u.String(), nil
}

// createDB (re)creates database name and returns its DSN.
func (e *pgEnv) createDB(ctx context.Context, name string) (string, error) {
	conn, err := pgx.Connect(ctx, e.srv.DSN)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.Background())
	id := pgx.Identifier{name}.Sanitize()
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+id+" WITH (FORCE)"); err != nil {
		return "", err
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+id); err != nil {
		return "", err
	}
	return e.dbDSN(name)
}

// newPool opens a pool of up to maxConns connections and opens them all, so
// that no timed run pays for connecting.
func newPool(ctx context.Context, dsn string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = maxConns
	cfg.MinConns = 0
	cfg.HealthCheckPeriod = time.Minute
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	conns := make([]*pgxpool.Conn, 0, maxConns)
	for range maxConns {
		c, err := pool.Acquire(ctx)
		if err != nil {
			for _, c := range conns {
				c.Release()
			}
			pool.Close()
			return nil, err
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Release()
	}
	return pool, nil
}

// ---- L0: the physical limit, one single-row UPDATE (one commit) per op ----

const l0Rows = 10000

func setupL0(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `
DROP TABLE IF EXISTS bench_l0;
CREATE TABLE bench_l0 (id int PRIMARY KEY, v bigint NOT NULL DEFAULT 0);
INSERT INTO bench_l0 (id) SELECT g FROM generate_series(1, `+fmt.Sprint(l0Rows)+`) g;`)
	if err != nil {
		return err
	}
	_, err = pool.Exec(ctx, "VACUUM ANALYZE bench_l0")
	return err
}

func l0Variant(pool *pgxpool.Pool, hot bool, clients int) variant {
	name := "random row"
	if hot {
		name = "hot row"
	}
	return variant{name: name, clients: clients, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		return closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			id := 1
			if !hot {
				id = 1 + rand.IntN(l0Rows)
			}
			_, err := pool.Exec(ctx, "UPDATE bench_l0 SET v = v + 1 WHERE id = $1", id)
			return err
		})
	}}
}
