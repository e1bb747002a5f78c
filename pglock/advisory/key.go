package advisory

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// maxNameBytes is the longest key name accepted, in bytes. It matches the limit
// on lease names in pgfence.locks, so one name can be used for both.
const maxNameBytes = 512

// nameKeySQL is the SQL expression that computes the key [Name] derives from
// the text parameter $1, for use from psql in a UTF8 database:
//
//	SELECT pg_try_advisory_lock(('x' || left(encode(sha256(convert_to('invoice:42', 'UTF8')), 'hex'), 16))::bit(64)::bigint);
//
// It requires PostgreSQL 11 or newer (sha256).
const nameKeySQL = `('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 16))::bit(64)::bigint`

// nameHash32SQL is the SQL expression for the second half of a [Namespaced]
// key, computed from the text parameter $1:
//
//	SELECT pg_try_advisory_lock(7, ('x' || left(encode(sha256(convert_to('invoice:42', 'UTF8')), 'hex'), 8))::bit(32)::int);
const nameHash32SQL = `('x' || left(encode(sha256(convert_to($1, 'UTF8')), 'hex'), 8))::bit(32)::int`

// Mode is the lock mode: [Exclusive] (one holder) or [Shared] (any number of
// shared holders, excluding exclusive ones). The zero value is Exclusive.
type Mode uint8

// The lock modes.
const (
	// Exclusive conflicts with every other lock on the key (pg_advisory_lock).
	Exclusive Mode = iota
	// Shared conflicts only with Exclusive (pg_advisory_lock_shared): a
	// readers' lock.
	Shared
)

// String returns "exclusive" or "shared".
func (m Mode) String() string {
	switch m {
	case Exclusive:
		return "exclusive"
	case Shared:
		return "shared"
	}
	return "Mode(" + strconv.Itoa(int(m)) + ")"
}

func (m Mode) valid(op string) error {
	if m > Shared {
		return invalid(op, "mode", "%v is neither Exclusive nor Shared", m)
	}
	return nil
}

type keyForm uint8

const (
	formNone  keyForm = iota // zero Key
	formInt64                // pg_advisory_lock(bigint)
	formPair                 // pg_advisory_lock(int, int)
)

// Key identifies an advisory lock. PostgreSQL has two disjoint key spaces: one
// bigint, and a pair of ints (shown in pg_locks with objsubid 1 and 2). A Key
// made by [Name] or [Int64] lives in the first, one made by [Namespaced] or
// [Pair] in the second, so Int64(5) and Pair(0, 5) are different locks.
//
// Keys are comparable values: two Keys are == exactly when they name the same
// lock. The zero Key is invalid and rejected with [pgfence.ErrInvalid]
// (Reason "key: zero Key ...").
type Key struct {
	form keyForm
	v    int64 // bigint key, or hi<<32 | uint32(lo) for a pair
}

// Name returns the bigint key for a name: the first 8 bytes of the SHA-256
// digest of the name's UTF-8 bytes, read as a big-endian two's-complement
// int64. The definition is part of the API and never changes; in
// PostgreSQL the same value is
//
//	('x' || left(encode(sha256(convert_to(name, 'UTF8')), 'hex'), 16))::bit(64)::bigint
//
// Names are hashed as given: case-sensitive, not Unicode-normalised.
//
// The name must be 1 to 512 bytes of valid UTF-8 without NUL bytes;
// otherwise the error is a [*pgfence.Error] matching [pgfence.ErrInvalid]
// whose Reason starts with "key name".
func Name(name string) (Key, error) {
	if err := checkName("advisory.Name", name); err != nil {
		return Key{}, err
	}
	return Key{form: formInt64, v: hash64(name)}, nil
}

// MustName is like [Name] but panics on an invalid name. It is meant for
// package-level keys built from constant names.
func MustName(name string) Key {
	k, err := Name(name)
	if err != nil {
		panic(err)
	}
	return k
}

// Namespaced returns a two-int key: namespace as the first int and the first
// 4 bytes of the SHA-256 digest of name (big-endian int32; in PostgreSQL
// ('x' || left(encode(sha256(convert_to(name, 'UTF8')), 'hex'), 8))::bit(32)::int)
// as the second. Use it to keep an application's locks apart
// from another's by namespace; within one namespace, 32 bits of hash make
// collisions likely after about 77,000 distinct names (50%), so prefer [Name]
// for large or unbounded sets of names. Name rules are those of [Name].
func Namespaced(namespace int32, name string) (Key, error) {
	if err := checkName("advisory.Namespaced", name); err != nil {
		return Key{}, err
	}
	return Pair(namespace, hash32(name)), nil
}

// Int64 returns the bigint key k as is, for applications that already have a
// numeric identity (a row id).
func Int64(k int64) Key { return Key{form: formInt64, v: k} }

// Pair returns the two-int key (a, b) as is: pg_advisory_lock(a, b).
func Pair(a, b int32) Key {
	return Key{form: formPair, v: int64(uint64(uint32(a))<<32 | uint64(uint32(b)))}
}

// Int64 returns the bigint key and true for a key in the bigint space ([Name],
// [Int64]); 0 and false otherwise.
func (k Key) Int64() (int64, bool) {
	if k.form != formInt64 {
		return 0, false
	}
	return k.v, true
}

// Pair returns the two ints and true for a key in the two-int space
// ([Namespaced], [Pair]); zeros and false otherwise.
func (k Key) Pair() (a, b int32, ok bool) {
	if k.form != formPair {
		return 0, 0, false
	}
	return int32(uint64(k.v) >> 32), int32(uint32(k.v)), true
}

// IsZero reports whether k is the invalid zero Key.
func (k Key) IsZero() bool { return k.form == formNone }

// String returns the key as the arguments of pg_advisory_lock: "123" for a
// bigint key, "7,-5" for a pair.
func (k Key) String() string {
	switch k.form {
	case formInt64:
		return strconv.FormatInt(k.v, 10)
	case formPair:
		a, b, _ := k.Pair()
		return strconv.FormatInt(int64(a), 10) + "," + strconv.FormatInt(int64(b), 10)
	}
	return "<zero key>"
}

func (k Key) valid(op string) error {
	if k.form == formNone {
		return invalid(op, "key", "zero Key (use Name, Namespaced, Int64 or Pair)")
	}
	return nil
}

// keyFromLocks rebuilds a Key from the pg_locks columns of an advisory lock.
func keyFromLocks(classid, objid uint32, objsubid int16) Key {
	v := int64(uint64(classid)<<32 | uint64(objid))
	if objsubid == 2 {
		return Key{form: formPair, v: v}
	}
	return Key{form: formInt64, v: v}
}

// checkName refuses a name that cannot be a key's (pgfence.ErrInvalid, the
// name in Name, cut to at most 64 bytes at a character boundary).
func checkName(op, name string) error {
	var why string
	switch {
	case name == "":
		why = "empty name"
	case len(name) > maxNameBytes:
		why = fmt.Sprintf("%d bytes, longer than %d", len(name), maxNameBytes)
	case !utf8.ValidString(name) || strings.IndexByte(name, 0) >= 0:
		why = "not valid UTF-8 text or contains a NUL byte (PostgreSQL text cannot hold it)"
	default:
		return nil
	}
	e := invalid(op, "key name", "%s", why)
	e.Name = cutName(name, 64)
	return e
}

// cutName returns name cut to at most n bytes followed by "..." when it is
// longer: before the UTF-8 character the cut would split, if any. Invalid
// bytes are no character and are cut where they are.
func cutName(name string, n int) string {
	if len(name) <= n {
		return name
	}
	cut := n
	for i := n; i >= 0 && i > n-utf8.UTFMax; i-- {
		if utf8.RuneStart(name[i]) {
			if r, size := utf8.DecodeRuneInString(name[i:]); (r != utf8.RuneError || size > 1) && i+size > n {
				cut = i
			}
			break
		}
	}
	return name[:cut] + "..."
}

func hash64(name string) int64 {
	sum := sha256.Sum256([]byte(name))
	return int64(binary.BigEndian.Uint64(sum[:8]))
}

func hash32(name string) int32 {
	sum := sha256.Sum256([]byte(name))
	return int32(binary.BigEndian.Uint32(sum[:4]))
}
