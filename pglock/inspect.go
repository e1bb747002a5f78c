package pglock

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/nilcheck"
)

// LockInfo is a snapshot of one lock row, read with [Inspect].
type LockInfo struct {
	Name      string
	Token     int64     // latest grant's token; 0 = never granted
	Holder    string    // "" when released
	ExpiresAt time.Time // database clock; zero when released
	Held      bool      // holder set and expires_at > now() on the database clock
	DBNow     time.Time // the database's now() when read
}

// Inspect reads the row of lock name from db. A name that was never granted
// returns a zero LockInfo with Name set and no error. The answer is advisory:
// it may change right after it is read.
func Inspect(ctx context.Context, db DBTX, name string) (LockInfo, error) {
	if nilcheck.IsNil(db) {
		return LockInfo{}, invalid(ErrNilDB, "nil database handle")
	}
	if err := validateName(name); err != nil {
		return LockInfo{}, err
	}
	h, err := dbsqlc.New().LockHolder(ctx, db, name)
	if errors.Is(err, pgx.ErrNoRows) {
		return LockInfo{Name: name}, nil
	}
	if err != nil {
		return LockInfo{}, &DBError{Op: "inspect", Name: name, Err: err}
	}
	info := LockInfo{Name: h.Name, Token: h.Token, Held: h.Held, DBNow: h.DbNow}
	if h.Holder != nil {
		info.Holder = *h.Holder
	}
	if h.ExpiresAt != nil {
		info.ExpiresAt = *h.ExpiresAt
	}
	return info, nil
}
