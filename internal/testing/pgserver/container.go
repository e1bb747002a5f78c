package pgserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
)

// EnvImage names the environment variable that chooses the image of the
// testcontainers path. Unset, it is [DefaultImage]. CI sets it to an image
// built from Debian's packages (pgfence/postgres-test:15), as no registry can
// be reached there; any image that keeps the official image's contract works
// (POSTGRES_USER, POSTGRES_PASSWORD and POSTGRES_DB honoured, password
// authentication from the network, "database system is ready to accept
// connections" logged once by the init server and once by the real one, sh,
// awk and grep present).
const EnvImage = "PGFENCE_TEST_IMAGE"

// DefaultImage is the image of the testcontainers path when [EnvImage] is
// unset: the official PostgreSQL 15 image from Docker Hub.
const DefaultImage = "postgres:15-alpine"

// ContainerImage returns the image the testcontainers path runs: the value
// of [EnvImage], or [DefaultImage].
func ContainerImage() string {
	if img := strings.TrimSpace(os.Getenv(EnvImage)); img != "" {
		return img
	}
	return DefaultImage
}

// NoEngineError is the testcontainers attempt's error when no Docker engine
// answers. It is the only container failure [Start] falls back from without
// a notice.
type NoEngineError struct {
	Err error
}

func (e *NoEngineError) Error() string { return "no Docker engine answers: " + e.Err.Error() }

func (e *NoEngineError) Unwrap() error { return e.Err }

// DockerAvailable reports whether a Docker engine answers, and why not (a
// [*NoEngineError]).
func DockerAvailable(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var err error
	func() {
		// testcontainers may panic when no Docker host can be resolved at all.
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("docker provider: %v", r)
			}
		}()
		var p *testcontainers.DockerProvider
		p, err = testcontainers.NewDockerProvider()
		if err != nil {
			return
		}
		err = p.Health(ctx)
	}()
	if err != nil {
		return &NoEngineError{Err: err}
	}
	return nil
}

// startContainer runs the container path. On success it writes the line that
// names the image and the container to notices.
func startContainer(ctx context.Context, logw, notices io.Writer) (*Server, error) {
	if err := DockerAvailable(ctx); err != nil {
		return nil, err
	}
	image := ContainerImage()
	fmt.Fprintf(logw, "pgserver: starting %s with testcontainers\n", image)
	c, err := tcpostgres.Run(ctx, image,
		tcpostgres.WithDatabase("postgres"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		if c != nil {
			_ = c.Terminate(context.Background())
		}
		return nil, fmt.Errorf("start container of image %s: %w", image, err)
	}
	dsn, err := c.ConnectionString(ctx, "sslmode=disable")
	if err == nil {
		err = loopbackDSN(dsn)
	}
	if err != nil {
		_ = c.Terminate(context.Background())
		return nil, fmt.Errorf("container of image %s: %w", image, err)
	}
	id := c.GetContainerID()
	fmt.Fprintf(notices, "pgserver: testcontainers: image %s, container %.12s\n", image, id)
	return &Server{
		Kind: KindTestcontainers,
		DSN:  dsn,
		terminate: func(ctx context.Context) error {
			return c.Terminate(ctx)
		},
	}, nil
}

// loopbackDSN fails unless the DSN's host is a loopback host: the tests talk
// to a container through a port published on this machine, never through a
// bridge address (testcontainers picks the bridge gateway when it believes it
// runs inside a container; TESTCONTAINERS_HOST_OVERRIDE=localhost stops that).
func loopbackDSN(dsn string) error {
	u, err := url.Parse(dsn)
	if err != nil {
		return fmt.Errorf("parse DSN: %w", err)
	}
	host := u.Hostname()
	if IsLoopbackHost(host) {
		return nil
	}
	return errors.New("testcontainers gave a DSN with host " + host + ", not a loopback host: " +
		"the tests connect to containers on loopback only " +
		"(inside a container or a VM marked as one, set TESTCONTAINERS_HOST_OVERRIDE=localhost)")
}

// IsLoopbackHost reports whether host is "localhost" or a loopback IP address.
func IsLoopbackHost(host string) bool {
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
