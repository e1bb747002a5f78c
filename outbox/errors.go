package outbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/pgerr"
	"github.com/pgfence/pgfence/pglock"
)

// The errors of this package are [*pgfence.Error]s; the helpers below build
// them. Op names the exported call ("outbox.Enqueue", "outbox.NewDispatcher",
// ...).

// invalid is rejected input (pgfence.ErrInvalid): arg names the argument,
// the rest says what is wrong with it. Nothing was sent to the database.
func invalid(op, arg, format string, args ...any) *pgfence.Error {
	return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Reason: arg + ": " + fmt.Sprintf(format, args...)}
}

// TranslateError turns the database's refusal of an intent into a
// [*pgfence.Error]: SQLSTATE PF003 (a newer grant exists) into
// [pgfence.ErrStaleToken], PF002 (the lock never issued the token) into
// [pgfence.ErrInvalid], PF012 (the lease is not held with its key) into
// [pgfence.ErrLost]; anything else is a database failure (no Kind, the
// driver's or the context's error as Err). nil stays nil, and a
// *pgfence.Error is returned as it is. [Enqueue] already calls it; call it
// on the error of your transaction's COMMIT, where the final check of every
// intent runs (the COMMIT checks the token only, so it never refuses with
// pgfence.ErrLost).
func TranslateError(err error) error { return translate("outbox.TranslateError", nil, err) }

// translate is TranslateError for the call op made under lease (nil when
// unknown: the lock name, token and key then come from the error's DETAIL).
func translate(op string, lease *pglock.Lease, err error) error {
	if err == nil {
		return nil
	}
	var pe *pgfence.Error
	if errors.As(err, &pe) {
		return err
	}
	lock, holder := "", ""
	if lease != nil {
		lock, holder = lease.Name(), lease.Holder()
	}
	if c, ok := pgerr.Classify(err); ok {
		e := &pgfence.Error{Op: op, Kind: c.Kind, Name: lock, Holder: holder, Reason: c.Meaning, Err: err}
		var pgErr *pgconn.PgError
		errors.As(err, &pgErr) // Classify found it
		switch c.Code {
		case pgerr.StaleToken:
			token, fence, _, key := pgerr.ParseRefusal(pgErr.Detail)
			e.Token = token
			e.Reason = fmt.Sprintf("intent refused: the lock has granted latest token %d since (intent key %s)",
				fence, keyOf(key))
		case pgerr.TokenNotIssued:
			r := refusal{lock: lock}
			parseNotIssued(pgErr.Detail, &r)
			e.Name, e.Token = r.lock, r.token
			e.Reason = fmt.Sprintf("token: the lock never issued it, or no lock has that name (latest token %d; intent key %s)",
				r.latest, r.key)
		case pgerr.LeaseNotHeld:
			r := refusal{lock: lock}
			parseNotIssued(pgErr.Detail, &r)
			e.Name, e.Token = r.lock, r.token
			e.Reason = "intent refused: the lease is not held with its key (released, expired, or another key) (intent key " +
				r.key + ")"
		case pgerr.InvalidToken:
			e.Reason = "token: refused by the server: must be > 0"
		case pgerr.BadArgument:
			e.Reason = "intent: refused by the server"
		}
		return e
	}
	if pgerr.PayloadNumberOutOfRange(err) {
		return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Name: lock, Reason: "Intent.Payload: " + pgerr.PayloadNumberReason, Err: err}
	}
	if pgerr.PayloadTooLarge(err) {
		return &pgfence.Error{Op: op, Kind: pgfence.ErrInvalid, Name: lock,
			Reason: fmt.Sprintf("payload: larger than the server's limit of %d bytes (text form)", maxPayloadBytes), Err: err}
	}
	return &pgfence.Error{Op: op, Name: lock, Err: err}
}

// refusal is what the DETAIL of a PF002 or PF012 refusal says.
type refusal struct {
	lock   string
	key    string
	token  int64
	latest int64
}

// parseNotIssued reads the DETAIL "op INSERT, key K, token N, lock L, latest
// token M" (M may be "none") of a PF002 or PF012 refusal.
func parseNotIssued(detail string, r *refusal) {
	_, rest, ok := strings.Cut(detail, ", key ")
	if !ok {
		return
	}
	i := strings.Index(rest, ", token ") // the key has no spaces
	j := strings.LastIndex(rest, ", latest token ")
	if i < 0 || j < i {
		return
	}
	r.key = keyOf(rest[:i])
	tok, lock, _ := strings.Cut(rest[i+len(", token "):j], ", lock ")
	r.token, _ = strconv.ParseInt(tok, 10, 64)
	if r.lock == "" {
		r.lock = lock
	}
	r.latest, _ = strconv.ParseInt(rest[j+len(", latest token "):], 10, 64)
}

// keyOf returns the idempotency key of the server's {"idempotency_key": K}.
func keyOf(s string) string {
	var v struct {
		Key string `json:"idempotency_key"`
	}
	if json.Unmarshal([]byte(s), &v) != nil || v.Key == "" {
		return s
	}
	return v.Key
}

// isNoRows reports pgx's "no rows".
func isNoRows(err error) bool { return errors.Is(err, pgx.ErrNoRows) }
