package migrations_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/pgfence/pgfence/migrations"
)

// The examples connect to the database named by DATABASE_URL.

// Apply pgfence's migrations at start-up. Several replicas may do this at
// once: one applies them, the others wait and find nothing to do.
func ExampleUpPool() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if err := migrations.UpPool(ctx, pool); err != nil {
		log.Fatal(err)
	}
	var exists bool
	if err := pool.QueryRow(ctx, "SELECT to_regclass('pgfence.locks') IS NOT NULL").Scan(&exists); err != nil {
		log.Fatal(err)
	}
	fmt.Println("pgfence.locks exists:", exists)
	// Output: pgfence.locks exists: true
}

// NewProvider returns goose's provider on pgfence's migrations and version
// table, for status reports and targeted migrations.
func ExampleNewProvider() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	p, err := migrations.NewProvider(ctx, db)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		log.Fatal(err)
	}
	pending, err := p.HasPending(ctx)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("pending:", pending)
	// Output: pending: false
}

// The migration files can be copied into an application's own goose
// directory instead.
func ExampleFS() {
	fmt.Println(migrations.VersionTable)
	// Output: pgfence.goose_db_version
}
