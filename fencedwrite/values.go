package fencedwrite

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/dbsqlc"
	"github.com/pgfence/pgfence/internal/nilcheck"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/internal/pgtext"
)

// Value is a row of pgfence.fenced_values, the small fenced key/value table
// shipped with the migrations (checkpoints, cursors, a leader's decisions).
type Value struct {
	Key       string          // the key the application chose, 1..512 bytes
	Value     json.RawMessage // the stored JSON document
	Fence     int64           // highest token the row accepted
	UpdatedAt time.Time       // database time of the latest accepted write
}

// maxKeyBytes is the limit of the fenced_values_key_length constraint and
// of the fenced value functions' key check.
const maxKeyBytes = 512

var queries = dbsqlc.New()

func checkValueArgs(db any, key string, value json.RawMessage, token int64, needValue bool) error {
	if nilcheck.IsNil(db) {
		return errNilDB()
	}
	if err := checkToken(token); err != nil {
		return err
	}
	if err := checkKey(key); err != nil {
		return err
	}
	if needValue {
		if !json.Valid(value) {
			return invalid("value", "not valid JSON")
		}
		if p := pgtext.JSONProblem(value); p != "" {
			return invalid("value", "%s", p)
		}
	}
	return nil
}

// checkKey refuses a key pgfence.fenced_values cannot hold.
func checkKey(key string) error {
	if key == "" || len(key) > maxKeyBytes {
		return invalid("key", "must be 1..%d bytes (got %d)", maxKeyBytes, len(key))
	}
	if p := pgtext.Problem(key); p != "" {
		return invalid("key", "%s", p)
	}
	return nil
}

func (q valueRereader) reread(ctx context.Context) (bool, int64, error) {
	f, err := queries.FenceOf(ctx, q.db, q.key)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, 0, nil
	}
	return err == nil, f, err
}

type valueRereader struct {
	db  pgfence.DBTX
	key string
}

// UpdateValue writes value under key in pgfence.fenced_values if the row's
// fence allows token (mode [Strict]: fence < token; [Reentrant]: fence <=
// token). On success the row's fence becomes token. Otherwise it returns
// [pgfence.ErrStaleToken], [pgfence.ErrAlreadyApplied] or
// [pgfence.ErrNotFound], decided in the same round trip. Bad input
// ([pgfence.ErrInvalid] naming the argument) is rejected before any SQL runs:
// a token not above 0, a key that is not 1..512 bytes of UTF-8 without NUL,
// a value that is not JSON or that jsonb does not store (invalid UTF-8, the
// escape \u0000, a surrogate escape without its pair).
// If ctx is cancelled while the statement runs, the write may or may not
// have been applied: repeat it with the same token (in strict mode
// [pgfence.ErrAlreadyApplied] means it was).
func UpdateValue(ctx context.Context, db pgfence.DBTX, token int64, mode Mode, key string, value json.RawMessage) (_ Result, err error) {
	defer withOp(&err, "fencedwrite.UpdateValue", key)
	return updateValue(ctx, db, token, mode, key, value)
}

// updateValue is [UpdateValue] without the Op.
func updateValue(ctx context.Context, db pgfence.DBTX, token int64, mode Mode, key string, value json.RawMessage) (Result, error) {
	if err := checkValueArgs(db, key, value, token, true); err != nil {
		return Result{}, err
	}
	var (
		applied bool
		fence   int64
		err     error
	)
	switch mode {
	case Strict:
		var row dbsqlc.FencedValueUpdateRow
		row, err = queries.FencedValueUpdate(ctx, db, dbsqlc.FencedValueUpdateParams{Key: key, Value: value, Token: token})
		applied, fence = row.Applied.Bool, row.Fence.Int64
	case Reentrant:
		var row dbsqlc.FencedValueUpdateReentrantRow
		row, err = queries.FencedValueUpdateReentrant(ctx, db, dbsqlc.FencedValueUpdateReentrantParams{Key: key, Value: value, Token: token})
		applied, fence = row.Applied.Bool, row.Fence.Int64
	default:
		return Result{}, invalid("mode", "unknown mode %v", mode)
	}
	return valueResult(ctx, db, mode, key, token, applied, fence, false, err, false)
}

// UpsertValue inserts key with value and fence = token, or, if the key
// exists, updates it under the fence check of mode. It never returns
// [pgfence.ErrNotFound]. Result.Inserted tells whether the row was new.
//
// A deleted key carries no fence: after [DeleteValue], an older grant may
// insert the key again. Use a tombstone value instead of deleting keys that
// older holders might still write.
func UpsertValue(ctx context.Context, db pgfence.DBTX, token int64, mode Mode, key string, value json.RawMessage) (_ Result, err error) {
	defer withOp(&err, "fencedwrite.UpsertValue", key)
	if err := checkValueArgs(db, key, value, token, true); err != nil {
		return Result{}, err
	}
	var (
		applied, inserted bool
		fence             int64
	)
	switch mode {
	case Strict:
		var row dbsqlc.FencedValueUpsertRow
		row, err = queries.FencedValueUpsert(ctx, db, dbsqlc.FencedValueUpsertParams{Key: key, Value: value, Token: token})
		applied, fence, inserted = row.Applied.Bool, row.Fence.Int64, row.Inserted.Bool
	case Reentrant:
		var row dbsqlc.FencedValueUpsertReentrantRow
		row, err = queries.FencedValueUpsertReentrant(ctx, db, dbsqlc.FencedValueUpsertReentrantParams{Key: key, Value: value, Token: token})
		applied, fence, inserted = row.Applied.Bool, row.Fence.Int64, row.Inserted.Bool
	default:
		return Result{}, invalid("mode", "unknown mode %v", mode)
	}
	return valueResult(ctx, db, mode, key, token, applied, fence, inserted, err, true)
}

// DeleteValue deletes key unless a newer grant wrote it (fence <= token: a
// grant may delete a row it wrote itself). It returns [pgfence.ErrStaleToken]
// or [pgfence.ErrNotFound] when nothing was deleted.
func DeleteValue(ctx context.Context, db pgfence.DBTX, token int64, key string) (_ Result, err error) {
	defer withOp(&err, "fencedwrite.DeleteValue", key)
	if err := checkValueArgs(db, key, nil, token, false); err != nil {
		return Result{}, err
	}
	row, err := queries.FencedValueDelete(ctx, db, key, token)
	return valueResult(ctx, db, Reentrant, key, token, row.Applied.Bool, row.Fence.Int64, false, err, false)
}

// ReadValue is the fenced read of a read-modify-write: it returns the row
// and raises its fence to token (fence <= token), so a write by an older
// grant is refused from now on. Write the new value back with mode
// [Reentrant] and the same token. It returns [pgfence.ErrStaleToken] if a
// newer grant read or wrote the row, [pgfence.ErrNotFound] if there is no such
// key. The read is an UPDATE: it locks the row until the surrounding
// transaction ends.
func ReadValue(ctx context.Context, db pgfence.DBTX, token int64, key string) (_ Value, err error) {
	defer withOp(&err, "fencedwrite.ReadValue", key)
	return readValue(ctx, db, token, key)
}

// readValue is [ReadValue] without the Op.
func readValue(ctx context.Context, db pgfence.DBTX, token int64, key string) (Value, error) {
	if err := checkValueArgs(db, key, nil, token, false); err != nil {
		return Value{}, err
	}
	row, err := queries.FencedValueRead(ctx, db, key, token)
	if _, err := valueResult(ctx, db, Reentrant, key, token, row.Applied.Bool, row.Fence.Int64, false, err, false); err != nil {
		return Value{}, err
	}
	v := Value{Key: key, Value: row.Value, Fence: row.Fence.Int64}
	if row.UpdatedAt != nil {
		v.UpdatedAt = *row.UpdatedAt
	}
	return v, nil
}

// GetValue reads key without a fence: for display and inspection only. A
// read-modify-write must use [ReadValue] or [ModifyValue].
func GetValue(ctx context.Context, db pgfence.DBTX, key string) (_ Value, err error) {
	defer withOp(&err, "fencedwrite.GetValue", key)
	if nilcheck.IsNil(db) {
		return Value{}, errNilDB()
	}
	if err := checkKey(key); err != nil {
		return Value{}, err
	}
	row, err := queries.GetFencedValue(ctx, db, key)
	if errors.Is(err, pgx.ErrNoRows) {
		return Value{}, notFoundError(0)
	}
	if err != nil {
		return Value{}, translateErr(err)
	}
	return Value{Key: row.Key, Value: row.Value, Fence: row.Fence, UpdatedAt: row.UpdatedAt}, nil
}

// ModifyValue is a read-modify-write of one key in one transaction under one
// fence check: a fenced read (which raises the fence to token and locks the
// row), fn, and a re-entrant write of fn's result, committed together. If fn
// returns an error the transaction is rolled back, nothing changes (not even
// the fence), and the error is returned as is.
//
// db may be a pool, a connection or a transaction (then a savepoint is used).
// ctx bounds the whole transaction; on cancellation it is rolled back.
func ModifyValue(ctx context.Context, db Beginner, token int64, key string,
	fn func(current json.RawMessage) (json.RawMessage, error)) (_ Result, err error) {
	defer withOp(&err, "fencedwrite.ModifyValue", key)
	if err := checkValueArgs(db, key, nil, token, false); err != nil {
		return Result{}, err
	}
	if fn == nil {
		return Result{}, invalid("fn", "nil")
	}
	var res Result
	err = inTx(ctx, db, func(tx pgx.Tx) error {
		cur, err := readValue(ctx, tx, token, key)
		if err != nil {
			return err
		}
		next, err := fn(cur.Value)
		if err != nil {
			return err
		}
		res, err = updateValue(ctx, tx, token, Reentrant, key, next)
		return err
	})
	if err != nil {
		return Result{}, err
	}
	return res, nil
}

func valueResult(ctx context.Context, db pgfence.DBTX, mode Mode, key string, token int64,
	applied bool, fence int64, inserted bool, err error, upsert bool) (Result, error) {
	found := true
	if errors.Is(err, pgx.ErrNoRows) {
		found, err = false, nil
	}
	if err != nil {
		return Result{}, valueError(err)
	}
	if applied {
		return Result{Fence: fence, Inserted: inserted}, nil
	}
	rr := valueRereader{db: db, key: key}
	if upsert && !found {
		// The conflicting row was committed after the statement's snapshot.
		found, fence, err = rr.reread(ctx)
		if err != nil {
			return Result{}, translateErr(err)
		}
		if !found {
			return Result{}, concurrentError(token)
		}
	}
	return Result{}, refused(ctx, mode, token, found, fence, rr.reread)
}

// valueError translates an error of a call of a fenced value function. The
// functions check their arguments as checkValueArgs does, so PF011 is not
// expected; should the two checks ever disagree (the server measures a key in
// bytes of its own encoding, checkValueArgs in UTF-8), the refusal becomes
// [pgfence.ErrInvalid] naming the token or "key or value", caused by the
// PostgreSQL error. Anything else goes through [TranslateError].
func valueError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerr.BadArgument {
		if strings.Contains(pgErr.Message, ": token must") {
			e := invalid("token", "refused by the server")
			e.Err = err
			return e
		}
		e := invalid("key or value", "refused by the server")
		e.Err = err
		return e
	}
	return translateErr(err)
}

// inTx runs fn in a transaction begun on db and commits it; it rolls back on
// any error, a panic in fn, and fn ending its goroutine (runtime.Goexit, as
// t.Fatal does), which neither returns nor panics.
func inTx(ctx context.Context, db Beginner, fn func(tx pgx.Tx) error) (err error) {
	if nilcheck.IsNil(db) {
		return errNilDB()
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return translateErr(err)
	}
	done := false
	defer func() {
		if done {
			return
		}
		// On a context that outlives the caller's, bounded.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		_ = tx.Rollback(rctx)
		cancel()
	}()
	if err = fn(tx); err != nil {
		return err
	}
	done = true
	if err = tx.Commit(ctx); err != nil {
		return translateErr(err)
	}
	return nil
}

// rollbackTimeout bounds the rollback of a transaction whose caller's
// context may have ended.
const rollbackTimeout = 10 * time.Second
