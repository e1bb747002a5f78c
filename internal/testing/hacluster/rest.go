package hacluster

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"
)

// Member is one node as Patroni's GET /cluster reports it.
type Member struct {
	Name     string `json:"name"`
	Role     string `json:"role"`  // leader, sync_standby, replica
	State    string `json:"state"` // running, starting, stopped, ...
	Host     string `json:"host"`
	Port     int    `json:"port"`
	Timeline int    `json:"timeline"`
	Lag      any    `json:"lag"` // bytes, or "unknown"
}

// clusterView is GET /cluster.
type clusterView struct {
	Members []Member `json:"members"`
}

// NodeStatus is Patroni's GET /patroni of one node.
type NodeStatus struct {
	State       string        `json:"state"`
	Role        string        `json:"role"` // master (Patroni 3.0) or primary, replica
	Timeline    int           `json:"timeline"`
	SyncStandby bool          `json:"sync_standby"`
	Replication []Replication `json:"replication"`
	Unlocked    bool          `json:"cluster_unlocked"`
}

// Replication is one WAL sender of a primary, from GET /patroni.
type Replication struct {
	ApplicationName string `json:"application_name"`
	State           string `json:"state"`      // streaming, catchup, ...
	SyncState       string `json:"sync_state"` // sync, async, potential, quorum
}

// isPrimary reports whether a GET /patroni role is a primary's.
func isPrimary(role string) bool { return role == "master" || role == "primary" }

func (c *Cluster) restURL(n *Node, path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d%s", n.APIPort, path)
}

// getJSON GETs path from node n's REST API into v.
func (c *Cluster) getJSON(ctx context.Context, n *Node, path string, v any) error {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.restURL(n, path), nil)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	// GET /patroni answers 200; /cluster too. Anything else is an error.
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s on %s: %s: %s", path, n.Name, resp.Status, bytes.TrimSpace(b))
	}
	return json.Unmarshal(b, v)
}

// send makes a POST or PATCH with a JSON body and returns the status code
// and body.
func (c *Cluster) send(ctx context.Context, method string, n *Node, path string, body any, timeout time.Duration) (int, string, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return 0, "", err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, c.restURL(n, path), bytes.NewReader(b))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	// This request may take longer than the client's default timeout.
	client := &http.Client{}
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(bytes.TrimSpace(out)), nil
}
