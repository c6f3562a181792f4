/* Converts a PNG to a JPEG for fuzz_image's seed corpus (fuzz/make_seeds.sh builds and runs it):
   mkjpg IN.png OUT.jpg QUALITY GRAY(0|1) PROGRESSIVE(0|1). */
#include <png.h>
#include <jpeglib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char** argv) {
  if (argc != 6) return 2;
  png_image im; memset(&im, 0, sizeof im); im.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_file(&im, argv[1])) return 1;
  int gray = atoi(argv[4]);
  im.format = gray ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  unsigned char* px = malloc(PNG_IMAGE_SIZE(im));
  if (!png_image_finish_read(&im, NULL, px, 0, NULL)) return 1;
  FILE* f = fopen(argv[2], "wb");
  struct jpeg_compress_struct c; struct jpeg_error_mgr e; c.err = jpeg_std_error(&e);
  jpeg_create_compress(&c); jpeg_stdio_dest(&c, f);
  c.image_width = im.width; c.image_height = im.height; c.input_components = gray ? 1 : 3;
  c.in_color_space = gray ? JCS_GRAYSCALE : JCS_RGB; jpeg_set_defaults(&c); jpeg_set_quality(&c, atoi(argv[3]), TRUE);
  if (atoi(argv[5])) jpeg_simple_progression(&c);
  jpeg_start_compress(&c, TRUE);
  while (c.next_scanline < c.image_height) { JSAMPROW r = px + c.next_scanline * im.width * c.input_components; jpeg_write_scanlines(&c, &r, 1); }
  jpeg_finish_compress(&c); fclose(f); return 0;
}
