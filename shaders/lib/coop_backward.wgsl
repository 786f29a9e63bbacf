// What the two cooperative backward kernels share, prepended by the host
// after lib/coop.wgsl and lib/common.wgsl: coop/backward_dq.wgsl streams
// key tiles past its query rows, coop/backward_dkdv.wgsl query tiles past
// its key rows. Both own BR = 16 W rows (16 per subgroup, held in
// registers) and stream tiles of BS rows of the other side through `hs`:
// the D-wide input (K, or Q) at 0 and the DV-wide one (V, or dO) at
// DV_OFF. The kernels bind those two inputs as `streamed_d` and
// `streamed_dv`. Each tile's words are loaded into registers a tile ahead
// (load_d, load_dv), so that their latency hides behind a tile of
// products, and written to `hs` (store_d, store_dv) once the last reader
// of the previous tile is done.
//
// Every workgroup variable is a multiple of 16 bytes: cooperative loads
// and stores need 16-byte aligned pointers (see coop/forward.wgsl).

override W: u32 = 4u;
override WG: u32 = 32u * W;
override BR: u32 = 16u * W;
// Rows per streamed tile (the dQ kernel's BK, the dK/dV kernel's BQ).
override BS: u32 = 32u;
override D: u32 = 64u;
override DV: u32 = 64u;
// Row strides in halves, padded by 16 bytes so that the 16 rows a coopLoad
// reads start in different banks.
override KS: u32 = D + 8u;
override VS: u32 = DV + 8u;
override TS: u32 = BS + 8u;
// f32 scratch row stride (a 16-row slice of a product of the streamed
// tile, or BS columns of a gradient on the way out).
override FS: u32 = BS + 4u;
// Where the DV-wide streamed tile starts in `hs` (halves).
override DV_OFF: u32 = 32u * (64u + 8u);
override H_ELEMS: u32 = 9216u;
override F_ELEMS: u32 = 2304u;
// Words of the D-wide (DV-wide) streamed tile each invocation loads:
// ceil(BS D / 2 / WG).
override DW: u32 = 8u;
override DVW: u32 = 8u;

// The subgroups of a workgroup wait for each other inside a tile only
// around the staging of the streamed tile; the f32 scratch rows and the f16
// weight rows a subgroup writes are read by that subgroup alone, behind
// lib/coop.wgsl's scratch_barrier(). Its workgroup-wide form kept all
// subgroups in lockstep, so one's scalar step could not overlap another's
// products: on the H100 at (4,16,4096,64) the backward took 19.58 ms with
// workgroup barriers and 18.57 with subgroup ones.

// Streamed blocks of 16 rows per tile: BS / 16 is at most this.
const MAXSB: u32 = 4u;
// DW and DVW are at most MAXW (tiles::coop_backward_tiles keeps to it).
const MAXW: u32 = 32u;

var<workgroup> hs: array<f16, H_ELEMS>;

// Writes the two halves of word `w` at hs[at], hs[at + 1].
fn put2(at: u32, w: u32) {
    let x = unpack2x16float(w);
    hs[at] = f16(x.x);
    hs[at + 1u] = f16(x.y);
}

// The words of `n` rows of the D-wide streamed input from row `row` that
// this invocation stages (word e = i WG + lid: row e / (D / 2)); zeros
// past them.
fn load_d(row: u32, n: u32, lid: u32) -> array<u32, MAXW> {
    var w: array<u32, MAXW>;
    let d2 = D / 2u;
    for (var i = 0u; i < DW; i++) {
        let e = i * WG + lid;
        w[i] = 0u;
        if e < BS * d2 && e / d2 < n {
            w[i] = streamed_d[row * d2 + e];
        }
    }
    return w;
}

fn load_dv(row: u32, n: u32, lid: u32) -> array<u32, MAXW> {
    var w: array<u32, MAXW>;
    let d2 = DV / 2u;
    for (var i = 0u; i < DVW; i++) {
        let e = i * WG + lid;
        w[i] = 0u;
        if e < BS * d2 && e / d2 < n {
            w[i] = streamed_dv[row * d2 + e];
        }
    }
    return w;
}

fn store_d(w: array<u32, MAXW>, lid: u32) {
    let d2 = D / 2u;
    for (var i = 0u; i < DW; i++) {
        let e = i * WG + lid;
        if e < BS * d2 {
            put2((e / d2) * KS + 2u * (e % d2), w[i]);
        }
    }
}

fn store_dv(w: array<u32, MAXW>, lid: u32) {
    let d2 = DV / 2u;
    for (var i = 0u; i < DVW; i++) {
        let e = i * WG + lid;
        if e < BS * d2 {
            put2(DV_OFF + (e / d2) * VS + 2u * (e % d2), w[i]);
        }
    }
}
