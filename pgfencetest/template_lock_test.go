package pgfencetest_test

import (
	"context"
	"net/url"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/migrations"
	"github.com/pgfence/pgfence/pgfencetest"
)

// TestTemplateMadeOnceAcrossDatabases: two processes whose DSNs name two
// databases of one server make the role's template one after the other.
// The lock that serialises them was an advisory lock in the DSN's database,
// so each took its own: both made the template, and the second dropped the
// first's, half-made as it looked, under it (or failed to create it). Both
// calls here start together, as a role that has no template yet; both must
// succeed with the same, usable template.
func TestTemplateMadeOnceAcrossDatabases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := pgfencetest.New(t)
	role := "pgfencetest_two_dbs_" + randHex(t)
	id := pgx.Identifier{role}.Sanitize()
	if _, err := admin.Pool.Exec(ctx, "CREATE ROLE "+id+" LOGIN CREATEDB PASSWORD 'pgfencetest'"); err != nil {
		t.Fatal(err)
	}
	dbs := []string{"pgfencetest_two_dbs_a_" + randHex(t), "pgfencetest_two_dbs_b_" + randHex(t)}
	var made []string // databases to drop
	t.Cleanup(func() {
		ctx := context.Background()
		for _, name := range made {
			d := pgx.Identifier{name}.Sanitize()
			for _, s := range []string{"ALTER DATABASE " + d + " WITH IS_TEMPLATE false", "DROP DATABASE IF EXISTS " + d + " WITH (FORCE)"} {
				if _, err := admin.Pool.Exec(ctx, s); err != nil {
					t.Errorf("%s: %v", s, err)
				}
			}
		}
		if _, err := admin.Pool.Exec(ctx, "DROP ROLE "+id); err != nil {
			t.Errorf("drop role: %v", err)
		}
	})
	u, err := url.Parse(pgfencetest.ServerDSN())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(role, "pgfencetest")
	var dsns []string
	for _, db := range dbs {
		if _, err := admin.Pool.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{db}.Sanitize()+" OWNER "+id); err != nil {
			t.Fatal(err)
		}
		made = append(made, db)
		u.Path = "/" + db
		dsns = append(dsns, u.String())
	}
	want, err := pgfencetest.TemplateName(migrations.FS(), role)
	if err != nil {
		t.Fatal(err)
	}

	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
		names = make([]string, len(dsns))
		errs  = make([]error, len(dsns))
	)
	for i, dsn := range dsns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			names[i], errs[i] = pgfencetest.Template(dsn)
		}()
	}
	close(start)
	wg.Wait()
	var exists bool
	if err := admin.Pool.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)", want).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		made = append(made, want)
	}
	for i := range dsns {
		if errs[i] != nil {
			t.Errorf("the template through database %s: %v", dbs[i], errs[i])
		} else if names[i] != want {
			t.Errorf("the template through database %s is %s, want %s", dbs[i], names[i], want)
		}
	}
	if t.Failed() {
		return
	}
	// The template is whole: a copy of it has pgfence's schema.
	var ready bool
	if err := admin.Pool.QueryRow(ctx, "SELECT datistemplate FROM pg_database WHERE datname = $1", want).Scan(&ready); err != nil || !ready {
		t.Fatalf("template %s: ready %v, %v", want, ready, err)
	}
	clone := "pgfencetest_two_dbs_clone_" + randHex(t)
	if _, err := admin.Pool.Exec(ctx, "CREATE DATABASE "+clone+" TEMPLATE "+pgx.Identifier{want}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	made = append(made, clone)
	u.Path = "/" + clone
	conn, err := pgx.Connect(ctx, u.String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var migrated bool
	if err := conn.QueryRow(ctx, "SELECT pg_catalog.to_regclass('pgfence.locks') IS NOT NULL").Scan(&migrated); err != nil || !migrated {
		t.Fatalf("a copy of the template has no pgfence.locks (%v)", err)
	}
}
