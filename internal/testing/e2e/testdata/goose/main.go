// Command goose is the part of the goose command line that the docs'
// walk-through runs, `goose -dir DIR postgres DSN up`, built from the goose
// library this module already requires (the real command needs modules the
// test machine may not have). TestFencedWalkthrough puts it on PATH.
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"os"

	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"
	"github.com/pressly/goose/v3"
)

func main() {
	dir := flag.String("dir", ".", "migrations directory")
	flag.Parse()
	if flag.NArg() != 3 || flag.Arg(0) != "postgres" || flag.Arg(2) != "up" {
		fmt.Fprintln(os.Stderr, "usage: goose -dir DIR postgres DSN up (the only form this stand-in knows)")
		os.Exit(2)
	}
	db, err := sql.Open("pgx", flag.Arg(1))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer db.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, db, os.DirFS(*dir))
	if err == nil {
		var res []*goose.MigrationResult
		res, err = p.Up(context.Background())
		for _, r := range res {
			fmt.Println("OK", r.Source.Path)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "goose up:", err)
		os.Exit(1)
	}
}
