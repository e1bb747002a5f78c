// Package holder makes the default holder identity: the text a lease or a
// claim writes into the rows it holds, so that an operator can tell who holds
// what.
package holder

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
)

// Default returns "hostname/pid/random" with 8 random hex digits, so that two
// holders in one process differ. The host is "unknown-host" when the
// hostname cannot be read.
func Default() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown-host"
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}
