package advisory_test

import (
	"context"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"pgregory.net/rapid"

	"github.com/pgfence/pgfence/internal/testing/pgtest"
	"github.com/pgfence/pgfence/pglock/advisory"
)

// nameVectors pin the key derivation. They were computed independently of
// this package (SHA-256 of the UTF-8 bytes, first 8 / 4 bytes big-endian, as
// signed integers). Changing any of them breaks every deployed lock name.
var nameVectors = []struct {
	name   string
	key64  int64
	hash32 int32
}{
	{"a", -3848465438864589366, -896040686},
	{"pgfence", -47959973068715659, -11166552},
	{"invoice:42", 6688477336110245193, 1557282483},
	{"payout:2026-11-29", -1800805367609006347, -419282673},
	{"naïve-日本語", 6269504329506329047, 1459732728},
	{strings.Repeat("a", advisory.MaxNameBytes), 5123942256149421647, 1193010773},
}

func TestNameStabilityVectors(t *testing.T) {
	t.Parallel()
	for _, v := range nameVectors {
		k, err := advisory.Name(v.name)
		if err != nil {
			t.Fatalf("Name(%q): %v", v.name, err)
		}
		got, ok := k.Int64()
		if !ok || got != v.key64 {
			t.Errorf("Name(%q) = %d (bigint form %v), want %d", v.name, got, ok, v.key64)
		}
		nk, err := advisory.Namespaced(7, v.name)
		if err != nil {
			t.Fatalf("Namespaced(7, %q): %v", v.name, err)
		}
		a, b, ok := nk.Pair()
		if !ok || a != 7 || b != v.hash32 {
			t.Errorf("Namespaced(7, %q) = (%d,%d) pair form %v, want (7,%d)", v.name, a, b, ok, v.hash32)
		}
		if advisory.MustName(v.name) != k {
			t.Errorf("MustName(%q) != Name", v.name)
		}
	}
}

// TestNameKeySQLMatches checks that the documented SQL expressions compute
// the same keys as Go, so an operator can find a name's lock from psql.
func TestNameKeySQLMatches(t *testing.T) {
	t.Parallel()
	pool := pgtest.Pool(t)
	ctx := context.Background()
	names := []string{}
	for _, v := range nameVectors {
		names = append(names, v.name)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		names = append(names, randomName(r))
	}
	for _, n := range names {
		var k64 int64
		var h32 int32
		if err := pool.QueryRow(ctx, "SELECT "+advisory.NameKeySQL+", "+strings.ReplaceAll(advisory.NameHash32SQL, "$1", "$2"),
			n, n).Scan(&k64, &h32); err != nil {
			t.Fatalf("SQL for %q: %v", n, err)
		}
		want, _ := advisory.MustName(n).Int64()
		if k64 != want {
			t.Errorf("NameKeySQL(%q) = %d, Name = %d", n, k64, want)
		}
		_, b, _ := must(advisory.Namespaced(1, n)).Pair()
		if h32 != b {
			t.Errorf("NameHash32SQL(%q) = %d, Namespaced = %d", n, h32, b)
		}
	}
}

func must(k advisory.Key, err error) advisory.Key {
	if err != nil {
		panic(err)
	}
	return k
}

const alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:-_/.éß日本"

func randomName(r *rand.Rand) string {
	runes := []rune(alphabet)
	n := 1 + r.IntN(40)
	var b strings.Builder
	for range n {
		b.WriteRune(runes[r.IntN(len(runes))])
	}
	return b.String()
}

// TestNameNoCollisionsMillion hashes one million random names (seeded: name
// i is a pure function of i, so a failure reproduces) and requires that no two
// different names share a 64-bit key. For a uniform 64-bit hash the chance of
// any collision among 10^6 names is about 3e-8.
func TestNameNoCollisionsMillion(t *testing.T) {
	t.Parallel()
	const n = 1_000_000
	keys := make([]int64, n)
	buf := make([]byte, 0, 64)
	for i := range keys {
		buf = millionName(buf[:0], uint64(i))
		k, err := advisory.Name(string(buf))
		if err != nil {
			t.Fatalf("name %d %q: %v", i, buf, err)
		}
		keys[i], _ = k.Int64()
	}
	sorted := slices.Clone(keys)
	slices.Sort(sorted)
	for j := 1; j < n; j++ {
		if sorted[j] != sorted[j-1] {
			continue
		}
		// Find the names behind the shared key; the generator may repeat a
		// name, which is no collision.
		var names []string
		for i, k := range keys {
			if k == sorted[j] {
				names = append(names, string(millionName(nil, uint64(i))))
			}
		}
		for _, other := range names[1:] {
			if other != names[0] {
				t.Fatalf("names %q share key %d", names, sorted[j])
			}
		}
	}
}

// millionName appends random name number i: 6 to 40 bytes over a 64-symbol
// alphabet, drawn from splitmix64 at counters i<<32+1, i<<32+2, ... (names
// never share a counter, so their draws are independent).
func millionName(buf []byte, i uint64) []byte {
	const sym = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:-"
	state := (i << 32) * 0x9E3779B97F4A7C15
	next := func() uint64 {
		state += 0x9E3779B97F4A7C15
		z := state
		z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
		z = (z ^ (z >> 27)) * 0x94D049BB133111EB
		return z ^ (z >> 31)
	}
	x := next()
	n := 6 + int(x%35)
	for k := 0; k < n; k++ {
		if k%10 == 0 {
			x = next()
		}
		buf = append(buf, sym[x&63])
		x >>= 6
	}
	return buf
}

// TestKeyProperties checks, for generated names and ints, that key
// construction is deterministic, keeps the two PostgreSQL key spaces apart and
// round-trips the pair halves.
func TestKeyProperties(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(t *rapid.T) {
		name := rapid.StringMatching(`[^\x00]{1,100}`).Draw(t, "name")
		if len(name) > advisory.MaxNameBytes {
			t.Skip("too long")
		}
		k1, err := advisory.Name(name)
		if err != nil {
			t.Fatalf("Name(%q): %v", name, err)
		}
		if k2, _ := advisory.Name(name); k1 != k2 {
			t.Fatalf("Name not deterministic for %q", name)
		}
		ns := rapid.Int32().Draw(t, "ns")
		nk, err := advisory.Namespaced(ns, name)
		if err != nil {
			t.Fatal(err)
		}
		if a, _, ok := nk.Pair(); !ok || a != ns {
			t.Fatalf("Namespaced(%d,%q).Pair() = %d %v", ns, name, a, ok)
		}
		if _, ok := nk.Int64(); ok {
			t.Fatal("pair key reports a bigint form")
		}
		a, b := rapid.Int32().Draw(t, "a"), rapid.Int32().Draw(t, "b")
		p := advisory.Pair(a, b)
		if ga, gb, ok := p.Pair(); !ok || ga != a || gb != b {
			t.Fatalf("Pair(%d,%d) round trip = %d,%d", a, b, ga, gb)
		}
		v := rapid.Int64().Draw(t, "v")
		if g, ok := advisory.Int64(v).Int64(); !ok || g != v {
			t.Fatalf("Int64(%d) round trip = %d", v, g)
		}
		for _, k := range []advisory.Key{p, advisory.Int64(v), nk, k1} {
			if k.String() == "" || k.IsZero() {
				t.Fatalf("key %v prints %q, zero %v", k, k.String(), k.IsZero())
			}
		}
		if advisory.Int64(v) == p {
			t.Fatal("bigint and pair keys compare equal")
		}
	})
}

func TestKeyString(t *testing.T) {
	t.Parallel()
	cases := map[advisory.Key]string{
		advisory.Int64(-5):             "-5",
		advisory.Pair(7, -1):           "7,-1",
		{}:                             "<zero key>",
		advisory.Pair(-1<<31, 1<<31-1): "-2147483648,2147483647",
	}
	for k, want := range cases {
		if got := k.String(); got != want {
			t.Errorf("String() = %q, want %q", got, want)
		}
	}
	if !(advisory.Key{}).IsZero() || advisory.Int64(0).IsZero() {
		t.Error("IsZero wrong")
	}
	if advisory.Exclusive.String() != "exclusive" || advisory.Shared.String() != "shared" || advisory.Mode(9).String() != "Mode(9)" {
		t.Error("Mode.String wrong")
	}
}

func TestNameValidation(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		want string // in the Reason, after "key name: "
	}{
		{"", "empty name"},
		{strings.Repeat("x", advisory.MaxNameBytes+1), "longer than 512"},
		{"bad\xffutf8", "not valid UTF-8"},
		{"nul\x00byte", "NUL byte"},
	}
	for _, c := range cases {
		wantName := c.name
		if len(wantName) > 64 {
			wantName = wantName[:64] + "..."
		}
		for op, f := range map[string]func(string) (advisory.Key, error){
			"advisory.Name":       advisory.Name,
			"advisory.Namespaced": func(n string) (advisory.Key, error) { return advisory.Namespaced(1, n) },
		} {
			_, err := f(c.name)
			pe := pfError(err)
			if !isInvalid(err, "key name") || !strings.Contains(pe.Reason, c.want) || pe.Name != wantName || pe.Op != op {
				t.Errorf("%s(%q) error = %v, want ErrInvalid for the key name: %s", op, c.name, err, c.want)
			}
		}
	}
	func() {
		defer func() {
			if r := recover(); r == nil {
				t.Error("MustName(\"\") did not panic")
			}
		}()
		advisory.MustName("")
	}()
	// SQL-looking names are just names.
	if _, err := advisory.Name("x'); SELECT pg_advisory_unlock_all(); --"); err != nil {
		t.Errorf("SQL-looking name refused: %v", err)
	}
	_ = time.Second
}

// TestNameValidationCutsAtCharacter: the Name of a refused key name is cut to
// 64 bytes before the UTF-8 character the cut would split, never inside it.
func TestNameValidationCutsAtCharacter(t *testing.T) {
	t.Parallel()
	x := strings.Repeat("x", 64)
	long := strings.Repeat("y", advisory.MaxNameBytes) // makes the name too long
	cases := []struct {
		name, want string
	}{
		{x[:63] + "é" + long, x[:63] + "..."},           // é is bytes 63-64
		{x[:61] + "😀" + long, x[:61] + "..."},           // 😀 is bytes 61-64
		{x[:62] + "😀" + long, x[:62] + "..."},           // 😀 is bytes 62-65
		{x[:63] + "€" + "\x00", x[:63] + "..."},         // € is bytes 63-65; NUL refused
		{x + "é" + long, x + "..."},                     // the cut splits nothing
		{x[:62] + "é" + "\xff" + long, x[:62] + "é..."}, // an invalid byte is cut where it is
		{x + "\x80x", x + "..."},                        // a stray continuation byte, not a character
	}
	for _, c := range cases {
		_, err := advisory.Name(c.name)
		got := "<no *pgfence.Error>"
		if pe := pfError(err); pe != nil {
			got = pe.Name
		}
		if !isInvalid(err, "key name") || got != c.want || !utf8.ValidString(got) {
			t.Errorf("Name(%q): error %v with Name %q, want ErrInvalid with Name %q", c.name[:min(len(c.name), 70)], err, got, c.want)
		}
	}
}
