package migrations_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/migrations"
)

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
}

// The migration files can be copied into an application's own goose
// directory instead.
func ExampleFS() {
	fmt.Println(migrations.VersionTable)
	// Output: pgfence.goose_db_version
}
