package faultsuite

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/fencedwrite"
	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock"
)

// hostileStrings is a corpus of names, holders and identifiers that have
// broken SQL built by pasting strings.
var hostileStrings = []string{
	"'", `"`, `\`, "''; DROP TABLE pgfence.locks; --", `"; DROP TABLE pgfence.locks; --`,
	"a\x00b", "\x00", strings.Repeat("x", 10*1024), strings.Repeat("é", 300),
	"🔒 lock", "\u202eevil", "%", "_", "name with spaces", "\n\r\t", "$1", "?", "\xff\xfe",
	"x' OR '1'='1", "pg_sleep(10)", "Robert'); DROP TABLE students;--",
}

// TestHostileInput feeds the corpus to lock names, holders and fencedwrite
// identifiers. Each call either works on exactly the row it names or fails
// with a typed validation error; no statement breaks and no other row changes.
func TestHostileInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := pgtest.Pool(t)
	if _, err := pool.Exec(ctx, `INSERT INTO pgfence.locks(name, token) VALUES ('sentinel', 41);
		CREATE TABLE things (id int PRIMARY KEY, v text, fence bigint NOT NULL DEFAULT 0);
		INSERT INTO things VALUES (1, 'keep', 3)`); err != nil {
		t.Fatal(err)
	}
	locker, err := pglock.New(pool, &pglock.Config{Holder: "hostile-test", PollOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer locker.Close()

	granted, refused := 0, 0
	for _, s := range hostileStrings {
		lease, err := locker.TryAcquire(ctx, s, time.Minute)
		switch {
		case err == nil:
			granted++
			var got string
			if err := pool.QueryRow(ctx, "SELECT name FROM pgfence.locks WHERE name = $1 AND token = $2", s, lease.Token()).Scan(&got); err != nil || got != s {
				t.Errorf("name %q: row not stored verbatim: %q %v", s, got, err)
			}
			if err := lease.Release(ctx); err != nil {
				t.Errorf("release %q: %v", s, err)
			}
		case errors.Is(err, pgfence.ErrInvalid):
			refused++
		default:
			t.Errorf("name %q: untyped error %v", s, err)
		}
		if _, err := pglock.New(pool, &pglock.Config{Holder: s}); err != nil && !errors.Is(err, pgfence.ErrInvalid) {
			t.Errorf("holder %q: untyped error %v", s, err)
		}
		_, err = fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: s, Key: []string{"id"}, Set: []string{"v"}})
		if err == nil {
			t.Errorf("table %q accepted", s)
		}
		_, err = fencedwrite.Prepare(ctx, pool, fencedwrite.Spec{Table: "things", Key: []string{"id"}, Set: []string{s}})
		if err == nil {
			t.Errorf("column %q accepted", s)
		}
	}
	// A forged (never issued) or wrong-holder token changes nothing.
	if err := locker.ReleaseToken(ctx, "sentinel", 41); !errors.Is(err, pgfence.ErrLost) {
		t.Errorf("release of a lock this holder never held: %v", err)
	}
	var token int64
	if err := pool.QueryRow(ctx, "SELECT token FROM pgfence.locks WHERE name = 'sentinel'").Scan(&token); err != nil || token != 41 {
		t.Fatalf("sentinel lock changed: token %d %v", token, err)
	}
	var v string
	var fence int64
	if err := pool.QueryRow(ctx, "SELECT v, fence FROM things WHERE id = 1").Scan(&v, &fence); err != nil || v != "keep" || fence != 3 {
		t.Fatalf("things row changed: %q %d %v", v, fence, err)
	}
	var tables int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE schemaname IN ('public', 'pgfence')").Scan(&tables); err != nil {
		t.Fatal(err)
	}
	t.Logf("hostile input: %d strings, %d granted verbatim, %d refused as invalid names, sentinel rows unchanged, %d tables intact",
		len(hostileStrings), granted, refused, tables)
	if granted == 0 || refused == 0 {
		t.Errorf("corpus did not exercise both paths (granted %d, refused %d)", granted, refused)
	}
}
