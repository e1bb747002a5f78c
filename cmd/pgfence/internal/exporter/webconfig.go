package exporter

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"go.yaml.in/yaml/v3"
	"golang.org/x/crypto/bcrypt"
)

// WebConfig is the part of the Prometheus exporters' web configuration file
// (the format of --web.config.file) that pgfence supports: TLS and basic
// auth. Any other key is an error, so a setting pgfence would ignore (say,
// a cipher list) is never silently dropped, and so is a setting that would
// not do what it says: a client_ca_file that the client_auth_type does not
// verify against, a client_auth_type that takes unverified certificates, an
// empty basic_auth_users. Example:
//
//	tls_server_config:
//	  cert_file: exporter.crt        # relative to the file's directory
//	  key_file: exporter.key
//	  client_ca_file: clients.crt    # optional: require client certificates
//	  min_version: TLS13             # TLS12 (default) or TLS13
//	basic_auth_users:
//	  prometheus: $2y$10$...         # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\n')
type WebConfig struct {
	TLSServerConfig *TLSServerConfig  `yaml:"tls_server_config"`
	BasicAuthUsers  map[string]string `yaml:"basic_auth_users"`

	tls   *tls.Config
	users map[string][]byte
	dummy []byte // bcrypt hash compared for unknown users, so timing does not tell them apart
}

// TLSServerConfig is the tls_server_config section of a [WebConfig].
type TLSServerConfig struct {
	// CertFile and KeyFile are PEM files of the server certificate (chain)
	// and its key. They are read again when they change on disk, so a
	// renewed certificate needs no restart.
	CertFile string `yaml:"cert_file"`
	KeyFile  string `yaml:"key_file"`
	// ClientCAFile, if set, holds the CAs that sign client certificates.
	ClientCAFile string `yaml:"client_ca_file"`
	// ClientAuthType is NoClientCert (no ClientCAFile),
	// VerifyClientCertIfGiven or RequireAndVerifyClientCert (both need
	// ClientCAFile). The default is RequireAndVerifyClientCert with
	// ClientCAFile, else NoClientCert. RequestClientCert and
	// RequireAnyClientCert are refused: they take any certificate, a
	// self-signed one too, and nothing checks it afterwards.
	ClientAuthType string `yaml:"client_auth_type"`
	// MinVersion is TLS12 (default) or TLS13.
	MinVersion string `yaml:"min_version"`
}

// LoadWebConfig reads and checks a web configuration file: YAML keys,
// bcrypt hashes, certificate and key. Relative file names are taken from the
// configuration file's directory.
func LoadWebConfig(path string) (*WebConfig, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("web config: %w", err)
	}
	var c WebConfig
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&c); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("web config %s: %w", path, err)
	}
	var extra any
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("web config %s: only one YAML document is allowed", path)
	}
	// Whether the sections are present at all, even empty or null (which
	// leaves them empty or nil): the keys were checked above.
	var present struct {
		TLS   yaml.Node `yaml:"tls_server_config"`
		Users yaml.Node `yaml:"basic_auth_users"`
	}
	if err := yaml.Unmarshal(data, &present); err != nil {
		return nil, fmt.Errorf("web config %s: %w", path, err)
	}
	if present.TLS.Kind != 0 && c.TLSServerConfig == nil {
		c.TLSServerConfig = &TLSServerConfig{} // refused below: no cert_file, no key_file
	}
	if err := c.prepare(filepath.Dir(path), present.Users.Kind != 0); err != nil {
		return nil, fmt.Errorf("web config %s: %w", path, err)
	}
	return &c, nil
}

func (c *WebConfig) prepare(dir string, usersGiven bool) error {
	if usersGiven && len(c.BasicAuthUsers) == 0 {
		// The exporters' toolkit serves without authentication then; a
		// file that names basic auth and lists no one is a mistake.
		return errors.New("basic_auth_users lists no user: the exporter would serve without authentication; " +
			"list at least one user, or remove the key")
	}
	if len(c.BasicAuthUsers) > 0 {
		c.users = map[string][]byte{}
		maxCost := bcrypt.MinCost
		names := make([]string, 0, len(c.BasicAuthUsers))
		for u := range c.BasicAuthUsers {
			names = append(names, u)
		}
		sort.Strings(names)
		for _, u := range names {
			h := c.BasicAuthUsers[u]
			if u == "" || strings.Contains(u, ":") {
				return fmt.Errorf("basic_auth_users: user name %q: must be non-empty and without ':'", u)
			}
			cost, err := bcrypt.Cost([]byte(h))
			if err != nil {
				return fmt.Errorf("basic_auth_users: user %q: the password must be given as a bcrypt hash: %v", u, err)
			}
			maxCost = max(maxCost, cost)
			c.users[u] = []byte(h)
		}
		secret := make([]byte, 32)
		_, _ = rand.Read(secret)
		dummy, err := bcrypt.GenerateFromPassword([]byte(fmt.Sprintf("%x", secret)[:60]), maxCost)
		if err != nil {
			return fmt.Errorf("basic_auth_users: %w", err)
		}
		c.dummy = dummy
	}
	t := c.TLSServerConfig
	if t == nil {
		return nil
	}
	abs := func(p string) string {
		if p == "" || filepath.IsAbs(p) {
			return p
		}
		return filepath.Join(dir, p)
	}
	if t.CertFile == "" || t.KeyFile == "" {
		return errors.New("tls_server_config: cert_file and key_file are both required")
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	switch t.MinVersion {
	case "", "TLS12":
	case "TLS13":
		cfg.MinVersion = tls.VersionTLS13
	default:
		return fmt.Errorf("tls_server_config: min_version %q: use TLS12 or TLS13", t.MinVersion)
	}
	if t.ClientCAFile != "" {
		pem, err := os.ReadFile(abs(t.ClientCAFile))
		if err != nil {
			return fmt.Errorf("tls_server_config: client_ca_file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("tls_server_config: client_ca_file %s holds no PEM certificate", t.ClientCAFile)
		}
		cfg.ClientCAs = pool
	}
	auth := t.ClientAuthType
	if auth == "" && t.ClientCAFile != "" {
		auth = "RequireAndVerifyClientCert"
	}
	switch auth {
	case "", "NoClientCert":
		cfg.ClientAuth = tls.NoClientCert
		if t.ClientCAFile != "" {
			return errors.New("tls_server_config: client_ca_file is set but client_auth_type is NoClientCert")
		}
	case "RequestClientCert", "RequireAnyClientCert":
		// Go's TLS does not verify these against ClientCAs, and pgfence
		// never looks at the certificate afterwards: a self-signed one
		// would pass, so the setting would authenticate no one.
		return fmt.Errorf("tls_server_config: client_auth_type %s takes any client certificate, self-signed too, "+
			"without checking it against client_ca_file; use RequireAndVerifyClientCert (or VerifyClientCertIfGiven) "+
			"with client_ca_file, or NoClientCert without it", auth)
	case "VerifyClientCertIfGiven":
		cfg.ClientAuth = tls.VerifyClientCertIfGiven
	case "RequireAndVerifyClientCert":
		cfg.ClientAuth = tls.RequireAndVerifyClientCert
	default:
		return fmt.Errorf("tls_server_config: client_auth_type %q is not one of NoClientCert, "+
			"VerifyClientCertIfGiven, RequireAndVerifyClientCert", auth)
	}
	if (cfg.ClientAuth == tls.VerifyClientCertIfGiven || cfg.ClientAuth == tls.RequireAndVerifyClientCert) && cfg.ClientCAs == nil {
		return fmt.Errorf("tls_server_config: client_auth_type %s needs client_ca_file", auth)
	}
	l := &certLoader{certFile: abs(t.CertFile), keyFile: abs(t.KeyFile)}
	if _, err := l.load(); err != nil {
		return fmt.Errorf("tls_server_config: %w", err)
	}
	cfg.GetCertificate = func(*tls.ClientHelloInfo) (*tls.Certificate, error) { return l.load() }
	c.tls = cfg
	return nil
}

// TLS returns the server's TLS configuration, or nil when the file has no
// tls_server_config (plain HTTP).
func (c *WebConfig) TLS() *tls.Config {
	if c == nil || c.tls == nil {
		return nil
	}
	return c.tls.Clone()
}

// HasBasicAuth reports whether the file lists basic_auth_users.
func (c *WebConfig) HasBasicAuth() bool { return c != nil && len(c.users) > 0 }

// Wrap returns next behind basic auth when the file lists users, else next
// itself. A successful check is remembered (by a SHA-256 of user and
// password) so a scraper does not pay a bcrypt comparison per scrape; at most
// two bcrypt comparisons run at once, so a flood of wrong passwords costs at
// most two cores.
func (c *WebConfig) Wrap(next http.Handler) http.Handler {
	if !c.HasBasicAuth() {
		return next
	}
	return &basicAuth{cfg: c, next: next, sem: make(chan struct{}, 2), ok: map[[32]byte]struct{}{}}
}

type basicAuth struct {
	cfg  *WebConfig
	next http.Handler
	sem  chan struct{}
	mu   sync.Mutex
	ok   map[[32]byte]struct{}
}

func (a *basicAuth) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if user, pass, ok := r.BasicAuth(); ok && a.check(r.Context(), user, pass) {
		a.next.ServeHTTP(w, r)
		return
	}
	w.Header().Set("WWW-Authenticate", `Basic realm="pgfence exporter", charset="UTF-8"`)
	http.Error(w, "Unauthorized", http.StatusUnauthorized)
}

func (a *basicAuth) check(ctx context.Context, user, pass string) bool {
	key := sha256.Sum256([]byte(user + "\x00" + pass))
	a.mu.Lock()
	_, hit := a.ok[key]
	a.mu.Unlock()
	if hit {
		return true
	}
	hash, known := a.cfg.users[user]
	if !known {
		hash = a.cfg.dummy
	}
	select {
	case a.sem <- struct{}{}:
	case <-ctx.Done():
		return false
	}
	err := bcrypt.CompareHashAndPassword(hash, []byte(pass))
	<-a.sem
	if err != nil || !known {
		return false
	}
	a.mu.Lock()
	if len(a.ok) >= 1024 {
		clear(a.ok)
	}
	a.ok[key] = struct{}{}
	a.mu.Unlock()
	return true
}

// certLoader reads the certificate and key again when either file's size or
// modification time changes; if the new pair does not load (say, a half
// written file), the previous one is kept.
type certLoader struct {
	certFile, keyFile string

	mu       sync.Mutex
	cert     *tls.Certificate
	certStat fileStamp
	keyStat  fileStamp
}

type fileStamp struct {
	size int64
	mod  time.Time
}

func stamp(path string) (fileStamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return fileStamp{size: fi.Size(), mod: fi.ModTime()}, nil
}

func (l *certLoader) load() (*tls.Certificate, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	cs, cerr := stamp(l.certFile)
	ks, kerr := stamp(l.keyFile)
	if l.cert != nil && (cerr != nil || kerr != nil || (cs == l.certStat && ks == l.keyStat)) {
		return l.cert, nil
	}
	cert, err := tls.LoadX509KeyPair(l.certFile, l.keyFile)
	if err != nil {
		if l.cert != nil {
			return l.cert, nil
		}
		return nil, err
	}
	l.cert, l.certStat, l.keyStat = &cert, cs, ks
	return l.cert, nil
}
