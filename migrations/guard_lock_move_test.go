package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/pgfence/pgfence/migrations"
)

// guardLockMoveVersion is migration 00023_pgfence_guard_lock_move.sql.
const guardLockMoveVersion = 23

// TestGuardLockMove: a guard with a lock name column refuses an UPDATE that
// moves a row to another lock. At version 22 a holder superseded on the
// row's lock A who held the latest token of lock C overwrote the row that
// A's newer holder had written, by setting its lock to C and its fence to
// C's token. At 23 that UPDATE fails with PF001 and changes nothing (the
// guard attached at 22 is attached again by the migration), and a write
// that keeps the row's lock still goes through.
func TestGuardLockMove(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, p := beforeMigration(t, ctx, guardLockMoveVersion)
	const key = `\x000102030405060708090a0b0c0d0e0f`
	// grant returns the next token of lock name (granted and released: the
	// guard compares with the latest token issued).
	grant := func(name string) (tok int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT token FROM pgfence.lock_grant($1, 'h', 60000000, '`+key+`')`, name).Scan(&tok); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `SELECT pgfence.lock_release($1, $2, '`+key+`')`, name, tok); err != nil {
			t.Fatal(err)
		}
		return tok
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE moved (id int PRIMARY KEY, lock text NOT NULL, v text, fence bigint NOT NULL DEFAULT 0);
		SELECT pgfence.guard('moved'::regclass, lock_name_column => 'lock')`); err != nil {
		t.Fatal(err)
	}
	// play returns the error of the move and the row after it.
	play := func(version int) (row string, moveErr error) {
		t.Helper()
		a, c := fmt.Sprintf("move-%d-a", version), fmt.Sprintf("move-%d-c", version)
		if _, err := pool.Exec(ctx, "INSERT INTO moved VALUES ($1, $2, 'orig', $3)", version, a, grant(a)); err != nil {
			t.Fatal(err)
		}
		newer := grant(a) // A's newer holder writes the row
		if _, err := pool.Exec(ctx, "UPDATE moved SET v = 'newer', fence = $2 WHERE id = $1 AND fence < $2", version, newer); err != nil {
			t.Fatal(err)
		}
		var cTok int64
		for range 3 {
			cTok = grant(c) // the superseded holder of A holds C's latest token
		}
		_, moveErr = pool.Exec(ctx, "UPDATE moved SET lock = $2, v = 'stale', fence = $3 WHERE id = $1 AND fence < $3", version, c, cTok)
		if err := pool.QueryRow(ctx, "SELECT format('%s/%s/%s', lock = $2, v, fence) FROM moved WHERE id = $1", version, a).Scan(&row); err != nil {
			t.Fatal(err)
		}
		return row, moveErr
	}

	v := guardLockMoveVersion - 1
	if row, err := play(v); err != nil || row != "f/stale/3" {
		t.Errorf("version %d: move %v, row (lock A/v/fence) %s; want no error and f/stale/3 (the old behaviour)", v, err, row)
	}
	if _, err := p.UpTo(ctx, guardLockMoveVersion); err != nil {
		t.Fatal(err)
	}
	v = guardLockMoveVersion
	if row, err := play(v); sqlState(err) != "PF001" || row != "t/newer/2" {
		t.Errorf("version %d: move %v, row (lock A/v/fence) %s; want PF001 and t/newer/2", v, err, row)
	}
	// A write under the row's own lock goes through.
	a := fmt.Sprintf("move-%d-a", v)
	tok := grant(a)
	if _, err := pool.Exec(ctx, "UPDATE moved SET v = 'own', fence = $2 WHERE id = $1 AND fence < $2", v, tok); err != nil {
		t.Errorf("version %d: a write under the row's own lock: %v", v, err)
	}
	if err := migrations.UpPool(ctx, pool); err != nil {
		t.Fatal(err)
	}
}
