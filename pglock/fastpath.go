package pglock

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/pgfence/pgfence/internal/dbsqlc"
)

// The fast path runs GrantLock and ReleaseLock, the statements of every
// acquire+release cycle (calls of pgfence.lock_grant and pgfence.lock_release),
// straight on the connection's pgconn: a statement prepared once per
// connection under a fixed name, parameters encoded into per-connection
// buffers, the result row decoded by hand. It sends the same SQL with the same
// parameters as the generated methods (it learns both from them, see
// recordStmt) and returns the same results and errors; it only saves pgx's
// per-call allocations (argument boxing, rows, scan plans). Whenever something
// is not as expected it calls the generated method.

// fastQ runs the generated methods when the fast path does not apply.
var fastQ = dbsqlc.New()

// fastGrantRow is dbsqlc.GrantLockRow without pointers: Token is 0 where it
// would be NULL (not granted), HasExpiry and HasHolder are false where
// ExpiresAt and HeldBy would be nil.
type fastGrantRow struct {
	Token     int64
	ExpiresAt time.Time
	HasExpiry bool
	HeldBy    string
	HasHolder bool
	DbNow     time.Time
}

// fastGrantLock is dbsqlc.New().GrantLock(ctx, conn, arg): same SQL, same
// semantics, same errors.
func fastGrantLock(ctx context.Context, conn *pgxpool.Conn, arg dbsqlc.GrantLockParams) (fastGrantRow, error) {
	var p [fastMaxParams]fastParam
	p[grantName] = fastParam{text: arg.Name}
	p[grantHolder] = fastParam{text: arg.Holder}
	p[grantTtlUs] = fastParam{int: arg.TtlUs}
	p[grantKey] = fastParam{bytes: arg.Key}
	fc, v, ok, err := fastQueryRow(ctx, conn, fastStmts().grant, &p)
	switch {
	case !ok:
		return slowGrantLock(ctx, conn, arg)
	case err != nil:
		return fastGrantRow{}, err
	}
	var row fastGrantRow
	if len(v) > 0 && v[0] != nil {
		if row.Token, err = decodeInt8(v, 0); err != nil {
			return fastGrantRow{}, err
		}
	}
	if row.ExpiresAt, row.HasExpiry, err = decodeTimestamptz(v, 1, fc.loc); err != nil {
		return fastGrantRow{}, err
	}
	if len(v) > 2 && v[2] != nil {
		row.HeldBy, row.HasHolder = string(v[2]), true
	}
	var hasNow bool
	if row.DbNow, hasNow, err = decodeTimestamptz(v, 3, fc.loc); err != nil {
		return fastGrantRow{}, err
	} else if !hasNow {
		return fastGrantRow{}, errors.New("can't scan into dest[3]: lock_grant returned no db_now")
	}
	return row, nil
}

func slowGrantLock(ctx context.Context, conn *pgxpool.Conn, arg dbsqlc.GrantLockParams) (fastGrantRow, error) {
	r, err := fastQ.GrantLock(ctx, conn, arg)
	if err != nil {
		return fastGrantRow{}, err
	}
	row := fastGrantRow{Token: r.Token.Int64}
	if r.ExpiresAt != nil {
		row.ExpiresAt, row.HasExpiry = *r.ExpiresAt, true
	}
	if r.HeldBy != nil {
		row.HeldBy, row.HasHolder = *r.HeldBy, true
	}
	if r.DbNow == nil {
		return fastGrantRow{}, errors.New("lock_grant returned no db_now")
	}
	row.DbNow = *r.DbNow
	return row, nil
}

// fastReleaseRow is dbsqlc.ReleaseLockRow with NULL read as false.
type fastReleaseRow struct{ Released, HandedOff, Notified bool }

// fastReleaseLock is dbsqlc.New().ReleaseLock(ctx, conn, arg): same SQL,
// same semantics, same errors.
func fastReleaseLock(ctx context.Context, conn *pgxpool.Conn, arg dbsqlc.ReleaseLockParams) (fastReleaseRow, error) {
	var p [fastMaxParams]fastParam
	p[releaseName] = fastParam{text: arg.Name}
	p[releaseToken] = fastParam{int: arg.Token}
	p[releaseKey] = fastParam{bytes: arg.Key}
	_, v, ok, err := fastQueryRow(ctx, conn, fastStmts().release, &p)
	switch {
	case !ok:
		r, err := fastQ.ReleaseLock(ctx, conn, arg)
		return fastReleaseRow{Released: r.Released.Bool, HandedOff: r.HandedOff.Bool, Notified: r.Notified.Bool}, err
	case err != nil:
		return fastReleaseRow{}, err
	}
	var row fastReleaseRow
	if row.Released, err = decodeBool(v, 0); err != nil {
		return fastReleaseRow{}, err
	}
	if row.HandedOff, err = decodeBool(v, 1); err != nil {
		return fastReleaseRow{}, err
	}
	if row.Notified, err = decodeBool(v, 2); err != nil {
		return fastReleaseRow{}, err
	}
	return row, nil
}

// fastQueryRow runs st with the parameters p and returns the values of its
// first row, copied into the connection's scratch (valid until its next
// statement), as QueryRow would scan them: no row = pgx.ErrNoRows. ok =
// false means the fast path does not apply (nothing was sent): the caller
// runs the generated method.
func fastQueryRow(ctx context.Context, conn *pgxpool.Conn, st *fastStmt, p *[fastMaxParams]fastParam) (fc *fastConn, vals [][]byte, ok bool, err error) {
	fc = fastConnFor(conn)
	if st == nil || fc == nil {
		return nil, nil, false, nil
	}
	rr, err := fc.exec(ctx, conn, st, p)
	if errors.Is(err, errFastUnusable) {
		return nil, nil, false, nil
	}
	if err != nil {
		return fc, nil, true, err
	}
	got := false
	for rr.NextRow() {
		if got {
			continue // QueryRow scans the first row only
		}
		got = true
		vals = fc.keepRow(rr.Values())
	}
	if _, err := rr.Close(); err != nil {
		fc.afterError(ctx, conn, st, err)
		return fc, nil, true, err
	}
	if !got {
		return fc, nil, true, pgx.ErrNoRows
	}
	return fc, vals, true, nil
}

// keepRow copies a row's values (valid only until the next row is read) into
// the connection's scratch, keeping NULLs as nil.
func (fc *fastConn) keepRow(v [][]byte) [][]byte {
	fc.row = fc.row[:0]
	fc.rowBuf = fc.rowBuf[:0]
	for _, b := range v {
		fc.rowBuf = append(fc.rowBuf, b...)
	}
	start := 0
	for _, b := range v {
		if b == nil {
			fc.row = append(fc.row, nil)
			continue
		}
		fc.row = append(fc.row, fc.rowBuf[start:start+len(b):start+len(b)])
		start += len(b)
	}
	return fc.row
}

// PostgreSQL type OIDs of the parameters and result columns.
const (
	oidBool        = 16
	oidBytea       = 17
	oidInt8        = 20
	oidText        = 25
	oidTimestamptz = 1184
)

const fastMaxParams = 4

// Field indexes of the parameter structs, in declaration order, and the
// sentinel values recordStmt passes for them.
const (
	grantName = iota
	grantHolder
	grantTtlUs
	grantKey
)

const (
	releaseName = iota
	releaseToken
	releaseKey
)

const (
	sentinelHolder = "\x00pgfence fastpath sentinel holder"
	sentinelName   = "\x00pgfence fastpath sentinel name"
	sentinelInt    = int64(-0x5eed_f00d_cafe_b0b1)
	sentinelKey    = "\x00pgfence fastpath sentinel key"
)

// sentinelOf is the map key of a sentinel argument: recordStmt looks the
// arguments up by it ([]byte is not comparable).
func sentinelOf(a any) string { return fmt.Sprintf("%T %q", a, a) }

// fastStmt is one statement as the generated method sends it.
type fastStmt struct {
	name    string // prepared statement name: "pgfence_fast_<method>_<hash of sql>"
	sql     string
	nparams int
	// fieldAt[pos] is the struct field (grantName...) sent as parameter
	// pos ($1 = 0).
	fieldAt [fastMaxParams]int
	// paramOIDs and paramFormats are by position: text parameters are sent
	// in text format as pgx sends strings, bigint and bytea ones in binary.
	paramOIDs    [fastMaxParams]uint32
	paramFormats []int16
	// resultOIDs are the result columns' types, read in binary format.
	resultOIDs    []uint32
	resultFormats []int16
}

type fastStatements struct{ grant, release *fastStmt }

// fastStmts learns the statements from the generated methods, once. A nil
// statement means its fast path is off.
var fastStmts = sync.OnceValue(func() fastStatements {
	return fastStatements{
		grant: recordStmt("grant", []uint32{oidInt8, oidTimestamptz, oidText, oidTimestamptz}, func(db dbsqlc.DBTX) error {
			_, err := fastQ.GrantLock(context.Background(), db, dbsqlc.GrantLockParams{Name: sentinelName, Holder: sentinelHolder, TtlUs: sentinelInt, Key: []byte(sentinelKey)})
			return err
		}, map[string]int{sentinelOf(sentinelName): grantName, sentinelOf(sentinelHolder): grantHolder, sentinelOf(sentinelInt): grantTtlUs, sentinelOf([]byte(sentinelKey)): grantKey}),
		release: recordStmt("release", []uint32{oidBool, oidBool, oidBool}, func(db dbsqlc.DBTX) error {
			_, err := fastQ.ReleaseLock(context.Background(), db, dbsqlc.ReleaseLockParams{Name: sentinelName, Token: sentinelInt, Key: []byte(sentinelKey)})
			return err
		}, map[string]int{sentinelOf(sentinelName): releaseName, sentinelOf(sentinelInt): releaseToken, sentinelOf([]byte(sentinelKey)): releaseKey}),
	}
})

// recordStmt calls a generated method (call) on a recording DBTX with
// sentinel arguments, and returns the SQL it sends and the parameter position
// of every field (sentinels maps each sentinel to its field). It returns nil,
// which turns the fast path off, unless the method sent exactly one QueryRow
// with exactly one parameter per field and scanned its result.
func recordStmt(method string, resultOIDs []uint32, call func(dbsqlc.DBTX) error, sentinels map[string]int) *fastStmt {
	var rec recordingDBTX
	if err := call(&rec); !errors.Is(err, errRecorded) || rec.calls != 1 || !rec.queryRow {
		return nil
	}
	if len(rec.args) != len(sentinels) || len(rec.args) > fastMaxParams {
		return nil
	}
	st := &fastStmt{sql: rec.sql, nparams: len(rec.args), resultOIDs: resultOIDs}
	seen := make(map[int]bool)
	for pos, a := range rec.args {
		switch a.(type) {
		case string:
			st.paramOIDs[pos] = oidText
			st.paramFormats = append(st.paramFormats, 0)
		case int64:
			st.paramOIDs[pos] = oidInt8
			st.paramFormats = append(st.paramFormats, 1)
		case []byte:
			st.paramOIDs[pos] = oidBytea
			st.paramFormats = append(st.paramFormats, 1)
		default:
			return nil
		}
		f, ok := sentinels[sentinelOf(a)]
		if !ok || seen[f] {
			return nil
		}
		seen[f] = true
		st.fieldAt[pos] = f
	}
	for range resultOIDs {
		st.resultFormats = append(st.resultFormats, 1) // binary
	}
	sum := sha256.Sum256([]byte(rec.sql))
	st.name = "pgfence_fast_" + method + "_" + hex.EncodeToString(sum[:8])
	return st
}

var errRecorded = errors.New("pglock: statement recorded, not executed")

// recordingDBTX records the statement a generated method sends and runs
// nothing.
type recordingDBTX struct {
	calls    int
	queryRow bool
	sql      string
	args     []any
}

func (r *recordingDBTX) record(sql string, args []any) {
	r.calls++
	r.sql, r.args = sql, args
}

func (r *recordingDBTX) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	r.record(sql, args)
	return pgconn.CommandTag{}, errRecorded
}

func (r *recordingDBTX) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	r.record(sql, args)
	return nil, errRecorded
}

func (r *recordingDBTX) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	r.record(sql, args)
	r.queryRow = true
	return recordedRow{}
}

type recordedRow struct{}

func (recordedRow) Scan(...any) error { return errRecorded }

// fastParam is one parameter value: text, int when the position is bigint,
// bytes when it is bytea.
type fastParam struct {
	text  string
	int   int64
	bytes []byte
}

// fastConn is the fast path's state of one connection, kept in its pgconn's
// CustomData: whether the connection runs statements the way the fast path
// does, and scratch buffers (a pooled connection is used by one goroutine at
// a time).
type fastConn struct {
	usable bool
	loc    *time.Location // pgx's timestamptz ScanLocation (nil: local time)
	buf    []byte
	vals   [fastMaxParams][]byte
	row    [][]byte // the first row's values (see keepRow)
	rowBuf []byte
}

const fastConnKey = "pgfence/pglock.fastConn"

// fastBufKeep bounds the parameter buffer a connection keeps: two names of
// maxNameBytes and maxHolderBytes and a bigint fit.
const fastBufKeep = 2048

// errFastUnusable: the fast path does not apply to this statement on this
// connection (nothing was sent); call the generated method.
var errFastUnusable = errors.New("pglock: fast path unusable")

// fastConnFor returns the fast path's state of conn, nil when the generated
// methods must be used.
func fastConnFor(conn *pgxpool.Conn) *fastConn {
	pc := conn.Conn().PgConn()
	data := pc.CustomData()
	if fc, ok := data[fastConnKey].(*fastConn); ok {
		if !fc.usable {
			return nil
		}
		return fc
	}
	if data == nil {
		return nil
	}
	fc := newFastConn(conn.Conn())
	data[fastConnKey] = fc
	if !fc.usable {
		return nil
	}
	return fc
}

// newFastConn decides, once per connection, whether the generated methods
// would run the statements as the fast path does: a cached prepared
// statement (pgx's default QueryExecModeCacheStatement), no tracer to call,
// and pgx's own codecs for the parameter and result types (the timestamptz
// codec's ScanLocation is applied).
func newFastConn(c *pgx.Conn) *fastConn {
	fc := &fastConn{}
	cfg := c.Config()
	if cfg.DefaultQueryExecMode != pgx.QueryExecModeCacheStatement || cfg.StatementCacheCapacity <= 0 || cfg.Tracer != nil {
		return fc
	}
	m := c.TypeMap()
	for _, oid := range []uint32{oidBool, oidBytea, oidInt8, oidText, oidTimestamptz} {
		t, ok := m.TypeForOID(oid)
		if !ok {
			return fc
		}
		switch codec := t.Codec.(type) {
		case pgtype.BoolCodec:
			ok = oid == oidBool
		case pgtype.ByteaCodec:
			ok = oid == oidBytea
		case pgtype.Int8Codec:
			ok = oid == oidInt8
		case pgtype.TextCodec:
			ok = oid == oidText
		case *pgtype.TimestamptzCodec:
			ok = oid == oidTimestamptz
			fc.loc = codec.ScanLocation
		default:
			ok = false
		}
		if !ok {
			return fc
		}
	}
	fc.usable = true
	fc.buf = make([]byte, 0, 128)
	return fc
}

// exec sends st with the parameters p (by field) and returns its result
// reader, which the caller reads to the end and closes. errFastUnusable
// means nothing was sent: the prepared statement does not have the expected
// parameter or result types.
func (fc *fastConn) exec(ctx context.Context, conn *pgxpool.Conn, st *fastStmt, p *[fastMaxParams]fastParam) (*pgconn.ResultReader, error) {
	// Free once prepared: pgx keeps the description by name.
	sd, err := conn.Conn().Prepare(ctx, st.name, st.sql)
	if err != nil {
		return nil, err
	}
	if !st.matches(sd) {
		return nil, errFastUnusable
	}
	// Encode in position order into one buffer, then slice it (the
	// appends may move it).
	b := fc.buf[:0]
	var ends [fastMaxParams]int
	for pos := 0; pos < st.nparams; pos++ {
		v := &p[st.fieldAt[pos]]
		switch st.paramOIDs[pos] {
		case oidInt8:
			b = binary.BigEndian.AppendUint64(b, uint64(v.int))
		case oidBytea:
			b = append(b, v.bytes...)
		default:
			b = append(b, v.text...)
		}
		ends[pos] = len(b)
	}
	start := 0
	for pos := 0; pos < st.nparams; pos++ {
		fc.vals[pos] = b[start:ends[pos]:ends[pos]]
		start = ends[pos]
	}
	if cap(b) <= fastBufKeep {
		fc.buf = b
	} else {
		fc.buf = make([]byte, 0, fastBufKeep) // not kept for the connection's life
	}
	rr := conn.Conn().PgConn().ExecStatement(ctx, sd, fc.vals[:st.nparams], st.paramFormats, st.resultFormats)
	return rr, nil
}

// matches reports whether the prepared statement has the parameter and
// result types the fast path encodes and decodes.
func (st *fastStmt) matches(sd *pgconn.StatementDescription) bool {
	if sd == nil || len(sd.ParamOIDs) != st.nparams || len(sd.Fields) != len(st.resultOIDs) {
		return false
	}
	for i, oid := range sd.ParamOIDs {
		if oid != st.paramOIDs[i] {
			return false
		}
	}
	for i, f := range sd.Fields {
		if f.DataTypeOID != st.resultOIDs[i] {
			return false
		}
	}
	return true
}

// afterError drops the prepared statement when the server says it is gone
// or its plan no longer fits (pgx invalidates its cached statements on
// errors the same way), so that the next call prepares it again.
func (fc *fastConn) afterError(ctx context.Context, conn *pgxpool.Conn, st *fastStmt, err error) {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || conn.Conn().IsClosed() {
		return
	}
	switch pgErr.Code {
	case "0A000", // feature_not_supported: cached plan must not change result type
		"26000": // invalid_sql_statement_name: prepared statement does not exist
		_ = conn.Conn().Deallocate(ctx, st.name)
	}
}

func decodeInt8(v [][]byte, i int) (int64, error) {
	if len(v) <= i || v[i] == nil {
		return 0, fmt.Errorf("can't scan into dest[%d]: cannot scan NULL into *int64", i)
	}
	if len(v[i]) != 8 {
		return 0, fmt.Errorf("can't scan into dest[%d]: invalid length for int8: %v", i, len(v[i]))
	}
	return int64(binary.BigEndian.Uint64(v[i])), nil
}

func decodeBool(v [][]byte, i int) (bool, error) {
	if len(v) <= i || v[i] == nil {
		return false, fmt.Errorf("can't scan into dest[%d]: cannot scan NULL into *bool", i)
	}
	if len(v[i]) != 1 {
		return false, fmt.Errorf("can't scan into dest[%d]: invalid length for bool: %v", i, len(v[i]))
	}
	return v[i][0] == 1, nil
}

// pgx's range of timestamptz values it turns into time.Time.
var (
	tstzMin = time.Date(-4713, 11, 24, 0, 0, 0, 0, time.UTC)
	tstzEnd = time.Date(294277, 1, 1, 0, 0, 0, 0, time.UTC)
)

const microsecFromUnixEpochToY2K = 946_684_800 * 1_000_000

// decodeTimestamptz decodes a binary timestamptz as pgx scans it into a
// **time.Time: NULL gives ok = false; infinity is an error.
func decodeTimestamptz(v [][]byte, i int, loc *time.Location) (t time.Time, ok bool, err error) {
	if len(v) <= i || v[i] == nil {
		return time.Time{}, false, nil
	}
	if len(v[i]) != 8 {
		return time.Time{}, false, fmt.Errorf("can't scan into dest[%d]: timestamptz: invalid length %d", i, len(v[i]))
	}
	us := int64(binary.BigEndian.Uint64(v[i]))
	if us == math.MaxInt64 || us == math.MinInt64 {
		return time.Time{}, false, fmt.Errorf("can't scan into dest[%d]: cannot scan infinite timestamptz into *time.Time", i)
	}
	t = time.Unix(microsecFromUnixEpochToY2K/1_000_000+us/1_000_000,
		(microsecFromUnixEpochToY2K%1_000_000*1_000)+(us%1_000_000*1_000))
	if t.Before(tstzMin) || !t.Before(tstzEnd) {
		return time.Time{}, false, fmt.Errorf("can't scan into dest[%d]: timestamptz %d microseconds from 2000-01-01 is out of range", i, us)
	}
	if loc != nil {
		t = t.In(loc)
	}
	return t, true, nil
}
