package advisory

import (
	"context"
	"time"

	"github.com/pgfence/pgfence"
	"github.com/pgfence/pgfence/internal/nilcheck"
)

// LockInfo is one row of [List]: an advisory lock held or awaited by a
// backend of the current database.
type LockInfo struct {
	// Key is the lock's key, rebuilt from pg_locks (classid is the high 32
	// bits and objid the low 32 bits of a bigint key; for a two-int key they
	// are the two ints, objsubid tells the forms apart).
	Key Key
	// Mode is Exclusive (pg_locks.mode ExclusiveLock) or Shared (ShareLock).
	Mode Mode
	// Granted is false while the backend is waiting for the lock.
	Granted bool
	// PID is the backend's process ID (pg_terminate_backend(pid) frees all
	// its locks); 0 for a lock held by a prepared transaction.
	PID int32
	// User is the role the backend runs as.
	User string
	// ApplicationName is the backend's application_name ("" when unset).
	ApplicationName string
	// ClientAddr is the client's IP address, "" for a unix socket.
	ClientAddr string
	// ClientPort is the client's TCP port, -1 for a unix socket.
	ClientPort int32
	// State is pg_stat_activity.state: "active", "idle", "idle in
	// transaction", ...
	State string
	// BackendStart is when the backend (the client's connection) started.
	BackendStart time.Time
	// QueryStart is when the backend's current or last query started, nil if
	// none.
	QueryStart *time.Time
}

// listSQL lists the advisory locks of the current database with their
// holders. Keys are recombined in Go from classid/objid/objsubid.
const listSQL = `SELECT l.classid::bigint, l.objid::bigint, l.objsubid::pg_catalog.int2, l.mode, l.granted,
       coalesce(l.pid, 0), coalesce(a.usename::pg_catalog.text, ''), coalesce(a.application_name, ''),
       coalesce(pg_catalog.host(a.client_addr), ''), coalesce(a.client_port, -1), coalesce(a.state, ''),
       a.backend_start, a.query_start
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON (a.pid OPERATOR(pg_catalog.=) l.pid)
WHERE (l.locktype OPERATOR(pg_catalog.=) 'advisory')
  AND (l.database OPERATOR(pg_catalog.=) (SELECT oid FROM pg_catalog.pg_database WHERE (datname OPERATOR(pg_catalog.=) pg_catalog.current_database())))
ORDER BY l.classid, l.objid, l.objsubid, l.granted DESC, a.query_start NULLS LAST, l.pid`

// List returns the advisory locks held or awaited in the current database,
// with their backends (pg_locks joined to pg_stat_activity), ordered by key,
// granted first. PostgreSQL hides other roles' client details from a role
// that is neither superuser nor a member of pg_read_all_stats. A name-based
// key is recognised by computing [Name] for the candidate name. If ctx ends,
// the error matches ctx.Err().
func List(ctx context.Context, db pgfence.DBTX) ([]LockInfo, error) {
	if nilcheck.IsNil(db) {
		return nil, invalid("advisory.List", "db", "nil database handle")
	}
	rows, err := db.Query(ctx, listSQL, execMode)
	if err != nil {
		return nil, dbError("advisory.List", "list", Key{}, ctxErr(ctx, err))
	}
	var out []LockInfo
	for rows.Next() {
		var (
			classid, objid int64
			objsubid       int16
			mode           string
			li             LockInfo
			backendStart   *time.Time
		)
		if err := rows.Scan(&classid, &objid, &objsubid, &mode, &li.Granted, &li.PID, &li.User,
			&li.ApplicationName, &li.ClientAddr, &li.ClientPort, &li.State, &backendStart, &li.QueryStart); err != nil {
			rows.Close()
			return nil, dbError("advisory.List", "list", Key{}, err)
		}
		li.Key = keyFromLocks(uint32(classid), uint32(objid), objsubid)
		if mode == "ShareLock" {
			li.Mode = Shared
		}
		if backendStart != nil {
			li.BackendStart = *backendStart
		}
		out = append(out, li)
	}
	if err := rows.Err(); err != nil {
		return nil, dbError("advisory.List", "list", Key{}, ctxErr(ctx, err))
	}
	return out, nil
}
