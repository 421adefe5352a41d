// A registry with the OCI 1.1 referrers API for the end-to-end tests (distribution 2.8, the
// suite's main registry, lacks it): go-containerregistry's in-memory pkg/registry. Built by
// `cargo xtask test` from Debian's golang-github-google-go-containerregistry-dev source, in GOPATH
// mode (no module download). Usage: registry ADDR (e.g. 127.0.0.1:5000).
package main

import (
	"log"
	"net/http"
	"os"

	"github.com/google/go-containerregistry/pkg/registry"
)

func main() {
	if len(os.Args) != 2 {
		log.Fatal("usage: registry ADDR")
	}
	log.Fatal(http.ListenAndServe(os.Args[1], registry.New(registry.WithReferrersSupport(true))))
}
