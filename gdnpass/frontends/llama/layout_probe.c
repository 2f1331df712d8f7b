/* Prints the ggml struct layout of the build it is compiled against, as JSON (gdnpass.frontends.llama.build).
   The capture reads ggml_tensor / ggml_cgraph memory through these offsets and refuses a build whose layout differs
   from the one gdnpass was checked against. */
#include <stddef.h>
#include <stdio.h>

#include "ggml.h"
#include "ggml-impl.h"

#define T(f) printf("\"%s\": %zu, ", #f, offsetof(struct ggml_tensor, f))
#define G(f) printf("\"%s\": %zu, ", #f, offsetof(struct ggml_cgraph, f))
#define H(k, f) printf("\"%s\": %zu, ", k, offsetof(struct ggml_cgraph, visited_hash_set) + offsetof(struct ggml_hash_set, f))

int main(void) {
    printf("{\"tensor\": {");
    T(type); T(buffer); T(ne); T(nb); T(op); T(op_params); T(flags); T(src); T(view_src); T(view_offs); T(data); T(name);
    printf("\"n_op_params\": %zu, \"n_src\": %d, \"name_len\": %d, ", GGML_MAX_OP_PARAMS / sizeof(int32_t),
           GGML_MAX_SRC, GGML_MAX_NAME);
    printf("\"size\": %zu}, \"graph\": {", sizeof(struct ggml_tensor));
    G(n_nodes); G(n_leafs); G(nodes); G(leafs); G(use_counts);
    H("hash_size", size); H("hash_used", used); H("hash_keys", keys);
    printf("\"size\": %zu}}\n", sizeof(struct ggml_cgraph));
    return 0;
}
