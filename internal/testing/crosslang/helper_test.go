package crosslang

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/pglock"
)

// goLeaseWorker is the Go twin of the Python client's lease-worker (same
// flags, commands and result lines; see examples/python/pgfence.py): it
// takes the lease with pglock, then obeys "write ID VALUE" (the fenced
// UPDATE), "raw ID VALUE" (without the fence condition), "renew", "release"
// and "exit" from stdin. It returns the exit status.
func goLeaseWorker(args []string) int {
	fs := flag.NewFlagSet("lease-worker", flag.ContinueOnError)
	dsn := fs.String("dsn", "", "database URL")
	name := fs.String("name", "", "lease name")
	holder := fs.String("holder", "", "holder")
	ttlMS := fs.Int64("ttl-ms", 0, "lease TTL in milliseconds")
	table := fs.String("table", "", "fenced table (id, v, fence)")
	if len(args) == 0 || args[0] != "lease-worker" || fs.Parse(args[1:]) != nil {
		fmt.Fprintln(os.Stderr, "usage: lease-worker --dsn --name --holder --ttl-ms --table")
		return 2
	}
	if err := runGoLeaseWorker(*dsn, *name, *holder, time.Duration(*ttlMS)*time.Millisecond, *table); err != nil {
		fmt.Fprintln(os.Stderr, "lease-worker:", err)
		return 1
	}
	return 0
}

func runGoLeaseWorker(dsn, name, holder string, ttl time.Duration, table string) error {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, dsn)
	if err != nil {
		return err
	}
	defer pool.Close()
	locker, err := pglock.New(pool, &pglock.Config{Holder: holder})
	if err != nil {
		return err
	}
	defer func() { _ = locker.Close() }()
	actx, cancel := context.WithTimeout(ctx, time.Minute)
	lease, err := locker.Acquire(actx, name, ttl)
	cancel()
	if err != nil {
		return err
	}
	fmt.Println("acquired", lease.Token())
	tbl := pgx.Identifier(strings.Split(table, ".")).Sanitize()
	tok := lease.Token()
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		cmd := strings.SplitN(sc.Text(), " ", 3)
		op := cmd[0]
		var id int64
		if len(cmd) == 3 {
			if id, err = strconv.ParseInt(cmd[1], 10, 64); err != nil {
				return err
			}
		}
		valid := time.Now().Before(lease.Deadline())
		switch op {
		case "write":
			tag, err := pool.Exec(ctx, "UPDATE "+tbl+" SET v = $1, fence = $2 WHERE id = $3 AND fence < $2", cmd[2], tok, id)
			switch {
			case err != nil:
				fmt.Println("refused write", id, sqlState(err))
			case tag.RowsAffected() == 1:
				fmt.Printf("ok write %d %d local-valid=%v\n", id, tok, pyBool(valid))
			default:
				var fence int64
				if err := pool.QueryRow(ctx, "SELECT fence FROM "+tbl+" WHERE id = $1", id).Scan(&fence); err != nil {
					return err
				}
				why := "stale" // as the Python client: a fence below the token is a concurrent change
				if fence < tok {
					why = "changed"
				}
				fmt.Printf("refused write %d %s fence=%d local-valid=%v\n", id, why, fence, pyBool(valid))
			}
		case "raw":
			if _, err := pool.Exec(ctx, "UPDATE "+tbl+" SET v = $1, fence = $2 WHERE id = $3", cmd[2], tok, id); err != nil {
				fmt.Println("refused raw", id, sqlState(err))
			} else {
				fmt.Println("ok raw", id, tok)
			}
		case "renew", "release":
			f := lease.Renew
			if op == "release" {
				f = lease.Release
			}
			switch err := f(ctx); {
			case err == nil:
				fmt.Println("ok", op)
			case errors.Is(err, pgfence.ErrLost):
				fmt.Println("refused", op, "lost")
			default:
				return err
			}
		case "exit":
			return nil
		default:
			fmt.Println("error unknown command", op)
		}
	}
	return sc.Err()
}

// pyBool spells a bool as the Python client prints it.
type pyBool bool

func (b pyBool) String() string {
	if b {
		return "True"
	}
	return "False"
}

func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return "no-sqlstate"
}
